"""The key spec: golden vectors (any implementation can check itself against these) and an
independent re-implementation of the README's text."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch

from kvtier.client.errors import InvalidArgumentError
from kvtier.client.keys import Namespace, block_key, block_keys

LLAMA = Namespace(
    model="meta-llama/Llama-3.1-8B", revision="main", kv_dtype="bfloat16", block_tokens=4
)
OTHER = Namespace(
    model="m",
    kv_dtype="float16",
    block_tokens=2,
    tenant="acme",
    kv_layout="HND",
    tp_rank=1,
    tp_size=2,
    extra="lora=none",
)

GOLDEN_SEED = "749378cf6b6d49ea443508e29507492c815c38188fe698f09d2f239438f6a549"
GOLDEN_KEYS = [  # tokens 0..9 in blocks of 4: two full blocks, two tokens left over
    "6e0753a394d061f29b3dc9931a856089f4ddfde7b80de77e135a45a417db3ab6",
    "3aeaa925bec4586da8debf6b4edbfc379afe386b00a33096350b0fa719dc159f",
]
GOLDEN_OTHER_SEED = "b1380220a766f83dfc5dcf24a05ce09ecfbedbf4b11ebf793ef52e108962f00a"
GOLDEN_OTHER_KEY_1 = "0d6a82f2207d29a565692482d876b8c2f58d15296fb04ce0cd17ec73df38b322"


def test_golden_vectors():
    assert LLAMA.seed().hex() == GOLDEN_SEED
    assert [k.hex() for k in block_keys(LLAMA, list(range(10)))] == GOLDEN_KEYS
    assert OTHER.seed().hex() == GOLDEN_OTHER_SEED
    assert block_keys(OTHER, [1, 2, 3, 4], extras=[b"", b"img:abc"])[1].hex() == GOLDEN_OTHER_KEY_1


def _s(x: str) -> bytes:
    b = x.encode()
    return struct.pack("<I", len(b)) + b


def spec_keys(ns: Namespace, tokens: list[int], extras: list[bytes] | None = None) -> list[bytes]:
    """The README's spec, written out again without the library."""
    seed = hashlib.sha256(
        b"kvtier-namespace-v1"
        + _s(ns.model)
        + _s(ns.revision)
        + _s(ns.kv_dtype)
        + _s(ns.kv_layout)
        + struct.pack("<5I", ns.block_tokens, ns.tp_rank, ns.tp_size, ns.pp_rank, ns.pp_size)
        + _s(ns.tenant)
        + _s(ns.extra)
    ).digest()
    keys, prev = [], seed
    n = ns.block_tokens
    for i in range(len(tokens) // n):
        x = extras[i] if extras else b""
        body = (
            struct.pack(f"<I{n}I", n, *tokens[i * n : (i + 1) * n]) + struct.pack("<I", len(x)) + x
        )
        prev = hashlib.sha256(b"kvtier-block-v1" + prev + body).digest()
        keys.append(prev)
    return keys


@pytest.mark.parametrize("ns", [LLAMA, OTHER])
def test_library_follows_the_written_spec(ns):
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 2**32, 37, dtype=np.uint64)]
    assert block_keys(ns, tokens) == spec_keys(ns, tokens)


def test_keys_are_a_chain():
    keys = block_keys(LLAMA, list(range(12)))
    assert block_keys(LLAMA, list(range(8))) == keys[:2]
    # Same tokens in block 3, different history: different key.
    other = block_keys(LLAMA, [99, *list(range(1, 12))])
    assert other[2] != keys[2]
    assert block_key(keys[1], list(range(8, 12))) == keys[2]


@pytest.mark.parametrize(
    "change",
    [
        {"model": "x"},
        {"revision": "v2"},
        {"kv_dtype": "float16"},
        {"kv_layout": "HND"},
        {"tp_rank": 1, "tp_size": 2},
        {"pp_rank": 1, "pp_size": 2},
        {"tenant": "t"},
        {"extra": "e"},
    ],
)
def test_every_namespace_field_changes_every_key(change):
    import dataclasses

    other = dataclasses.replace(LLAMA, **change)
    assert set(block_keys(LLAMA, list(range(8)))).isdisjoint(block_keys(other, list(range(8))))


def test_only_full_blocks_have_keys():
    assert len(block_keys(LLAMA, list(range(7)))) == 1
    assert block_keys(LLAMA, []) == []


@pytest.mark.parametrize("tokens", [[-1, 0, 0, 0], [2**32, 0, 0, 0], [0.5, 1, 2, 3]])
def test_bad_tokens_are_refused(tokens):
    with pytest.raises(ValueError):
        block_keys(LLAMA, tokens)


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda: block_keys(LLAMA, [-1, 0, 0, 0]), r"^token_ids: token ids must lie in"),
        (lambda: block_keys(LLAMA, [0.5, 1, 2, 3]), r"^token_ids: token ids must be integers"),
        (
            lambda: block_keys(LLAMA, [[0, 1, 2, 3]]),
            r"^token_ids: token ids must be one-dimensional",
        ),
        (lambda: block_keys(LLAMA, list(range(8)), [b""]), r"^extras: 1 entries for 2 blocks"),
        (lambda: block_keys(LLAMA, list(range(4)), ["x"]), r"^extras\[0\]: expected bytes, a by"),
        (lambda: block_keys("m", list(range(4))), r"^namespace: expected a Namespace"),
        (lambda: block_key(b"x", [0, 1, 2, 3]), r"^parent: a key of 32 bytes, not 1 bytes"),
        (lambda: block_key(7, [0, 1, 2, 3]), r"^parent: a key of 32 bytes, not int"),
        (lambda: block_key(LLAMA.seed(), [2**32]), r"^tokens: token ids must lie in"),
        (lambda: block_key(LLAMA.seed(), [0], "x"), r"^extra: expected bytes, a bytearray or a"),
    ],
)
def test_regression_bad_block_key_arguments_raised_untyped_errors(call, says):
    """``block_keys`` and ``block_key`` are public, but raised a plain ValueError (or
    TypeError, AttributeError: a parent or namespace of another type, an extra that is no
    bytes) for a bad argument, where the rest of the client raises InvalidArgumentError (a
    ValueError too) naming the argument."""
    with pytest.raises(InvalidArgumentError, match=says) as refused:
        call()
    assert isinstance(refused.value, ValueError)


@pytest.mark.parametrize(
    "call, says",
    [
        (
            lambda: block_keys(LLAMA, list(range(8)), (x for x in [b"", b""])),
            r"^extras: expected a sequence, not generator$",
        ),
        (lambda: block_keys(LLAMA, list(range(8)), {b"", b"a"}), r"^extras: expected a seq"),
        (lambda: block_keys(LLAMA, list(range(4)), 5), r"^extras: expected a sequence, not int$"),
        (lambda: block_keys(LLAMA, list(range(4)), b"ab"), r"^extras: expected a sequence, not b"),
        (lambda: block_keys(LLAMA, list(range(4)), [7]), r"^extras\[0\]: expected bytes, a by"),
        (lambda: block_key(bytearray(3), [0]), r"^parent: a key of 32 bytes, not 3 bytes$"),
        (lambda: block_key(LLAMA.seed(), [0], 7), r"^extra: expected bytes, a bytearray or a m"),
    ],
)
def test_regression_extras_that_were_no_sequence_raised_type_error(call, says):
    """``len(extras)`` of a generator (or a set, an int) raised Python's TypeError, naming no
    argument: refused as every other bad argument of ``block_keys`` is."""
    with pytest.raises(InvalidArgumentError, match=says):
        call()


@pytest.mark.parametrize("extras", [{b"a": b"", b"b": b""}, {0: b"", 1: b"x"}])
def test_regression_extras_as_a_mapping_raised_key_error(extras):
    """A dict has a length and ``__getitem__``, so it passed as a sequence: ``extras[0]`` of
    one keyed by anything but the block numbers raised Python's KeyError, naming no argument,
    and one keyed by them was read as a list. A mapping is refused as no sequence (the keys,
    pages and segments of a transfer too)."""
    from kvtier.client.keys import sequence_len

    says = r"^extras: expected a sequence, not dict$"
    with pytest.raises(InvalidArgumentError, match=says):
        block_keys(LLAMA, list(range(8)), extras)
    with pytest.raises(InvalidArgumentError, match=r"^keys: expected a sequence, not dict$"):
        sequence_len(extras, "keys")


def test_regression_a_bytearray_or_memoryview_parent_or_extra_was_refused():
    """``parent`` and ``extra`` are "bytes" (their annotations; the README's spec: "the
    block's extra bytes"), and a type checker takes a bytearray or a memoryview for them, but
    both were refused at run time ("expected bytes, not bytearray"). The key is of the bytes
    they hold, as for the same ``bytes``."""
    tokens = list(range(8))
    extras = [b"img:1", b"img:2"]
    keys = block_keys(LLAMA, tokens, extras)
    assert block_keys(LLAMA, tokens, [bytearray(extras[0]), memoryview(extras[1])]) == keys
    assert block_key(bytearray(keys[0]), tokens[4:], memoryview(bytearray(extras[1]))) == keys[1]
    assert block_key(memoryview(keys[0]), tokens[4:], bytearray(extras[1])) == keys[1]
    # A memoryview of another format or shape: its bytes, as hashlib reads it.
    wide = np.frombuffer(keys[0], dtype=np.uint64)
    assert block_key(memoryview(wide), tokens[4:], extras[1]) == keys[1]


def test_regression_a_released_memoryview_raised_pythons_value_error():
    """A memoryview already released (its buffer given back) was read unchecked, and
    ``block_key`` and ``block_keys`` raised Python's ValueError ("operation forbidden on
    released memoryview object"), naming no argument. Refused naming it."""
    gone = memoryview(LLAMA.seed())
    gone.release()
    with pytest.raises(InvalidArgumentError, match=r"^parent: a released memoryview$"):
        block_key(gone, [0])
    with pytest.raises(InvalidArgumentError, match=r"^extra: a released memoryview$"):
        block_key(LLAMA.seed(), [0], gone)
    with pytest.raises(InvalidArgumentError, match=r"^extras\[1\]: a released memoryview$"):
        block_keys(LLAMA, list(range(8)), [b"", gone])


def test_bad_namespaces_are_refused():
    with pytest.raises(ValueError):
        Namespace(model="", kv_dtype="float16", block_tokens=4)
    with pytest.raises(ValueError):
        Namespace(model="m", kv_dtype="float16", block_tokens=0)
    with pytest.raises(ValueError):
        Namespace(model="m", kv_dtype="float16", block_tokens=4, tp_rank=2, tp_size=2)


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ({"model": ""}, r"^namespace model: must not be empty$"),
        ({"block_tokens": 0}, r"^namespace block_tokens: must be at least 1 \(got 0\)$"),
        (
            {"tp_rank": 2, "tp_size": 2},
            r"^namespace tp_rank: must be below tp_size \(got 2, tp_size 2\)$",
        ),
        (
            {"pp_rank": 0, "pp_size": 0},
            r"^namespace pp_rank: must be below pp_size \(got 0, pp_size 0\)$",
        ),
    ],
    ids=lambda v: ",".join(f"{k}={v[k]!r}" for k in v) if isinstance(v, dict) else "",
)
def test_regression_a_namespaces_older_refusals_were_plain_value_errors(field, message):
    """An empty model, a block size of 0 and a rank not below its size were refused with a
    plain ValueError naming no field ("ranks must satisfy 0 <= rank < size"), where the
    namespace's other refusals are InvalidArgumentError (a KvtierError, and a ValueError
    too) naming it: a caller catching KvtierError missed them. They are refused so too."""
    fields = {"model": "m", "kv_dtype": "float16", "block_tokens": 4, **field}
    with pytest.raises(InvalidArgumentError, match=message) as caught:
        Namespace(**fields)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ({"block_tokens": 4.0}, r"^namespace block_tokens: expected int, not float$"),
        ({"block_tokens": True}, r"^namespace block_tokens: expected int, not bool$"),
        ({"block_tokens": 2**32}, r"^namespace block_tokens: must lie in \[0, 2\*\*32\)$"),
        ({"tp_size": 1.5}, r"^namespace tp_size: expected int, not float$"),
        (
            {"tp_rank": 2**32, "tp_size": 2**32 + 1},
            r"^namespace tp_rank: must lie in \[0, 2\*\*32\)$",
        ),
        pytest.param(
            {"pp_size": 10**5000},
            r"^namespace pp_size: must lie in \[0, 2\*\*32\)$",
            id="pp_size=10**5000",
        ),
        ({"model": 5}, r"^namespace model: expected str, not int$"),
        ({"tenant": None}, r"^namespace tenant: expected str, not NoneType$"),
        ({"extra": b"lora"}, r"^namespace extra: expected str, not bytes$"),
        ({"kv_layout": "\ud800"}, r"^namespace kv_layout: not encodable as UTF-8 \("),
    ],
    ids=lambda v: ",".join(f"{k}={v[k]!r}" for k in v) if isinstance(v, dict) else "",
)
def test_regression_a_namespace_field_its_seed_cannot_hash_was_taken(field, message):
    """A namespace hashes its ints as u32 and its strs as UTF-8 (the spec above): one given a
    float block size (``16.0`` read from a config), a bool, an int past 32 bits or a field
    that is no str was taken, and so was a pool registered under it (``16.0 == 16``, the
    layout's block size), and every key of it then failed in the caller with struct's own
    ``struct.error`` (no ValueError, no client error: ``pool.store(tokens, pages)`` raised
    it) or an AttributeError. It is refused at construction, naming the field, as the
    client's other bad arguments are."""
    fields = {"model": "m", "kv_dtype": "float16", "block_tokens": 4, **field}
    with pytest.raises(InvalidArgumentError, match=message):
        Namespace(**fields)


@pytest.mark.parametrize("number", [np.int64(4), np.uint32(4)])
def test_a_namespace_takes_numpy_integers(number):
    ns = Namespace(model="m", kv_dtype="float16", block_tokens=number, tp_size=number)
    assert block_keys(ns, list(range(8))) == block_keys(
        Namespace(model="m", kv_dtype="float16", block_tokens=4, tp_size=4), list(range(8))
    )


@pytest.mark.parametrize(
    ("number", "kind"),
    [
        pytest.param(np.array([4]), "ndarray", id="np.array([4])"),
        pytest.param(np.array(4.0), "ndarray", id="np.array(4.0)"),
        pytest.param(torch.tensor(4.0), "Tensor", id="torch.tensor(4.0)"),
        pytest.param(torch.tensor([4, 4]), "Tensor", id="torch.tensor([4, 4])"),
    ],
)
def test_regression_an_int_field_whose_type_has_index_but_is_no_integer_raised_type_error(
    number, kind
):
    """The int fields' check took any value whose type has ``__index__`` for an integer: a
    NumPy array or a torch tensor has one, which refuses an array of floats or of more than
    one element, so ``Namespace(block_tokens=torch.tensor(4.0))`` raised that TypeError from
    the check, no InvalidArgumentError naming the field. Such a value is refused as any
    other that is no integer."""
    for name in ("block_tokens", "tp_size"):
        with pytest.raises(
            InvalidArgumentError, match=rf"^namespace {name}: expected int, not {kind}$"
        ):
            Namespace(**{"model": "m", "kv_dtype": "float16", "block_tokens": 4, name: number})
    # One integer in a 0-d array or tensor is an integer, as NumPy's scalars are.
    assert Namespace(model="m", kv_dtype="float16", block_tokens=torch.tensor(4)).seed() == (
        Namespace(model="m", kv_dtype="float16", block_tokens=4).seed()
    )


@pytest.mark.parametrize(
    "number",
    [
        pytest.param(np.array(4), id="np.array(4)"),
        pytest.param(torch.tensor(4), id="torch.tensor(4)"),
        pytest.param(np.uint32(4), id="np.uint32(4)"),
    ],
)
def test_regression_a_namespace_given_an_integer_array_or_tensor_hashed_wrong(number):
    """An int field given a 0-d integer array or tensor (an integer, as NumPy's scalars are)
    kept it as given: a namespace of ``np.array(4)`` raised TypeError (unhashable) as a dict
    key or set member, and one of ``torch.tensor(4)`` compared equal to the namespace of 4
    but hashed by the tensor's identity, so a dict keyed by namespaces missed it. The field
    holds the integer, a Python int, whatever type gave it."""
    plain = Namespace(model="m", kv_dtype="float16", block_tokens=4, tp_size=4, tp_rank=3)
    ns = Namespace(model="m", kv_dtype="float16", block_tokens=number, tp_size=number, tp_rank=3)
    assert ns == plain and hash(ns) == hash(plain)
    assert {plain: "pool"}[ns] == "pool"
    assert type(ns.block_tokens) is int and type(ns.tp_size) is int
    assert repr(ns) == repr(plain)
