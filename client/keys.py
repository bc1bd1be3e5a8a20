"""Block keys: the canonical, language-neutral spec (also written out in the README).

All integers are unsigned little-endian; ``u32(x)`` is 4 bytes, ``str(s)`` is
``u32(len(utf8(s))) || utf8(s)``; ``H`` is SHA-256.

    seed = H("kvtier-namespace-v1" || str(model) || str(revision) || str(kv_dtype)
             || str(kv_layout) || u32(block_tokens) || u32(tp_rank) || u32(tp_size)
             || u32(pp_rank) || u32(pp_size) || str(tenant) || str(extra))

    k_{-1} = seed
    k_i = H("kvtier-block-v1" || k_{i-1} || u32(n) || u32(t_0) || ... || u32(t_{n-1})
            || u32(len(x_i)) || x_i)

where ``t_0 .. t_{n-1}`` are the ``n == block_tokens`` token ids of block ``i`` and ``x_i`` is
the block's extra bytes (empty unless the engine mixes in, say, an image hash or a LoRA id).
Only full blocks have keys; a trailing partial block is never stored.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass

import numpy as np

from kvtier.client.errors import InvalidArgumentError

KEY_BYTES = 32
_NS_TAG = b"kvtier-namespace-v1"
_BLOCK_TAG = b"kvtier-block-v1"


def as_int(value: object) -> int | None:
    """``value`` as protobuf and the key seed read an integer (``operator.index``), or None
    for a bool or anything else: not whether its type has ``__index__``, since an array's or
    a tensor's refuses floats and more than one element with a TypeError."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def sequence_len(values: Sized, what: str) -> int:
    """``len(values)``; InvalidArgumentError naming ``what`` unless ``values`` is a sequence
    (a list, a range, an array: what the flows slice into batches), not a str or bytes, nor a
    mapping (a dict has a length and ``__getitem__``, but is read by its keys: ``extras[0]``
    raised KeyError, or read a dict keyed 0, 1, ... as a list)."""
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(type(values), "__getitem__"):
        raise InvalidArgumentError(f"{what}: expected a sequence, not {type(values).__name__}")
    try:
        return len(values)
    except TypeError:
        raise InvalidArgumentError(
            f"{what}: expected a sequence, not {type(values).__name__}"
        ) from None


# The namespace's fields as its seed hashes them: ``str(s)`` and ``u32(x)``.
_STR_FIELDS = ("model", "revision", "kv_dtype", "kv_layout", "tenant", "extra")
_U32_FIELDS = ("block_tokens", "tp_rank", "tp_size", "pp_rank", "pp_size")


def _str(s: str) -> bytes:
    data = s.encode("utf-8")
    return struct.pack("<I", len(data)) + data


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two engines' KV bytes for the same tokens differ.

    ``kv_layout`` names the byte order inside one chunk (``"NHD"`` is
    ``[tokens, heads, head_dim]``), not the pool's page layout: vLLM and FlashInfer pools with
    NHD chunks produce identical blocks and may share them.
    """

    model: str
    kv_dtype: str
    block_tokens: int
    revision: str = ""
    kv_layout: str = "NHD"
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tenant: str = "default"
    extra: str = ""

    def __post_init__(self) -> None:
        # Each field as the seed hashes it, checked here: one it cannot hash (a float block
        # size, an int past 32 bits, a field that is no str) was taken, and every key of it
        # then failed with struct's own error, once a pool was registered under it.
        for name in _STR_FIELDS:
            text = getattr(self, name)
            if not isinstance(text, str):
                raise InvalidArgumentError(
                    f"namespace {name}: expected str, not {type(text).__name__}"
                )
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidArgumentError(
                    f"namespace {name}: not encodable as UTF-8 ({e.reason})"
                ) from None
        ints: dict[str, int] = {}
        for name in _U32_FIELDS:
            number = getattr(self, name)
            if (value := as_int(number)) is None:
                raise InvalidArgumentError(
                    f"namespace {name}: expected int, not {type(number).__name__}"
                )
            if not 0 <= value <= 0xFFFFFFFF:
                raise InvalidArgumentError(f"namespace {name}: must lie in [0, 2**32)")
            # The int itself: a 0-d array kept as given made the namespace unhashable, and a
            # tensor hashed it by its identity, unlike the equal namespace of the int.
            object.__setattr__(self, name, value)
            ints[name] = value
        if not self.model:
            raise InvalidArgumentError("namespace model: must not be empty")
        if ints["block_tokens"] < 1:
            raise InvalidArgumentError(
                f"namespace block_tokens: must be at least 1 (got {ints['block_tokens']})"
            )
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            if not ints[rank] < ints[size]:  # both >= 0 (checked above)
                raise InvalidArgumentError(
                    f"namespace {rank}: must be below {size} (got {ints[rank]}, {size} "
                    f"{ints[size]})"
                )

    def seed(self) -> bytes:
        h = hashlib.sha256(_NS_TAG)
        h.update(_str(self.model))
        h.update(_str(self.revision))
        h.update(_str(self.kv_dtype))
        h.update(_str(self.kv_layout))
        h.update(
            struct.pack(
                "<5I", self.block_tokens, self.tp_rank, self.tp_size, self.pp_rank, self.pp_size
            )
        )
        h.update(_str(self.tenant))
        h.update(_str(self.extra))
        return h.digest()


def block_key(parent: bytes, tokens: Sequence[int] | np.ndarray, extra: bytes = b"") -> bytes:
    """The key of one block from its parent key (or the seed) and its token ids; ``parent``
    and ``extra`` are bytes, a bytearray or a memoryview (``_bytes_of``). A bad argument is
    InvalidArgumentError naming it (also a ValueError)."""
    key = _bytes_of(parent, "parent")
    if key is None or len(key) != KEY_BYTES:
        got = type(parent).__name__ if key is None else f"{len(key)} bytes"
        raise InvalidArgumentError(f"parent: a key of {KEY_BYTES} bytes, not {got}")
    return _chained(key, _token_bytes(tokens, "tokens"), _checked_extra(extra, "extra"))


def _bytes_of(value: object, what: str) -> bytes | None:
    """The bytes of ``value`` if it is bytes, a bytearray or a memoryview (of any format or
    shape: the bytes it holds, in C order), else None; a released memoryview, which holds
    none, is InvalidArgumentError naming ``what`` (Python's ValueError otherwise). ``parent``
    and ``extra`` are annotated ``bytes``, which a type checker takes either for, and the
    README's spec speaks of bytes: a bytearray or a memoryview was refused at run time."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        try:
            return bytes(value)
        except ValueError:  # "operation forbidden on released memoryview object"
            raise InvalidArgumentError(f"{what}: a released memoryview") from None
    return None


def _checked_extra(value: object, what: str) -> bytes:
    """A block's extra bytes (``_bytes_of``), or InvalidArgumentError naming ``what``."""
    if (extra := _bytes_of(value, what)) is None:
        raise InvalidArgumentError(
            f"{what}: expected bytes, a bytearray or a memoryview, not {type(value).__name__}"
        )
    return extra


def _chained(parent: bytes, ids: bytes, extra: bytes) -> bytes:
    """``block_key`` of arguments already checked, the token ids as ``_token_bytes`` gives
    them."""
    h = hashlib.sha256(_BLOCK_TAG)
    h.update(parent)
    h.update(struct.pack("<I", len(ids) // 4))
    h.update(ids)
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return h.digest()


def block_keys(
    namespace: Namespace,
    token_ids: Sequence[int] | np.ndarray,
    extras: Sequence[bytes] | None = None,
) -> list[bytes]:
    """Keys of every full block of ``token_ids``, chained from the namespace seed;
    ``extras``, if given, a sequence of at least one extra per full block, each bytes, a
    bytearray or a memoryview (``_bytes_of``). A bad argument is InvalidArgumentError naming
    it (also a ValueError, which these raised)."""
    if not isinstance(namespace, Namespace):
        raise InvalidArgumentError(
            f"namespace: expected a Namespace, not {type(namespace).__name__}"
        )
    n = namespace.block_tokens
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:  # a batch of sequences ([[...]]) had no full block: no keys, no error
        raise InvalidArgumentError(
            f"token_ids: token ids must be one-dimensional, not of shape {tokens.shape}"
        )
    nblocks = len(tokens) // n
    # A sequence, read by index: len() of a generator (a set, an int) raised TypeError.
    if extras is not None and (count := sequence_len(extras, "extras")) < nblocks:
        raise InvalidArgumentError(f"extras: {count} entries for {nblocks} blocks")
    # Checked and converted once (the refusal names "token_ids"), each block hashing its slice.
    ids = _token_bytes(tokens[: nblocks * n], "token_ids")
    step = 4 * n
    key = namespace.seed()
    keys = []
    for i in range(nblocks):
        extra = b"" if extras is None else extras[i]
        if type(extra) is not bytes:  # the name built only where it may be needed
            extra = _checked_extra(extra, f"extras[{i}]")
        key = _chained(key, ids[i * step : (i + 1) * step], extra)
        keys.append(key)
    return keys


def _token_bytes(tokens: Sequence[int] | np.ndarray, name: str) -> bytes:
    """The token ids as the key hashes them, or InvalidArgumentError naming the argument
    ``name``."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgumentError(
            f"{name}: token ids must be one-dimensional, not of shape {arr.shape}"
        )
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{name}: token ids must be integers, not {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF:
        raise InvalidArgumentError(f"{name}: token ids must lie in [0, 2**32)")
    return arr.astype("<u4").tobytes()
