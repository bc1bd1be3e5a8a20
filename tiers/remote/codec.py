"""How a block is named and framed in the remote store.

Key: ``<prefix><namespace token>:<block key as lowercase hex>``, as bytes. The namespace token
is the decimal namespace id unless the tier is given a mapping (a tenant's stable name, so
that daemons that number namespaces differently still meet on the same keys). Tokens are
checked to hold no ``:``, braces or whitespace, so the naming is injective: two
``(namespace, key)`` pairs never share a Redis key, and no key carries a cluster hash tag
(the block key is hex, the prefix is checked), so blocks spread over every slot.

Value: a 32-byte header, then the block's bytes::

    magic    4s  b"KVL3"
    version  u8  FORMAT_VERSION
    flags    u8  0 (reserved)
    reserved u16 0
    length   u64 the block's length in bytes
    checksum u64 xxh3-64 of the block's bytes
    key_tag  u64 xxh3-64 of the Redis key the value was written under

All integers little-endian. A value is served only if its header parses with this magic and
version, its length is the length asked for and matches the value's size, its key tag is its
own key's (a value copied or renamed under another tenant's key is refused), and the checksum
of its bytes matches. Anything else is a miss with a reason.
"""

from __future__ import annotations

import enum
import re
import struct
from collections.abc import Callable

import xxhash

MAGIC = b"KVL3"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBHQQQ")
HEADER_BYTES = _HEADER.size  # 32

_MAX_CACHED_NAMESPACES = 4096
_TOKEN_RE = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


def checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of ``data`` as an unsigned int (the same function as the disk tier's)."""
    return int(xxhash.xxh3_64_intdigest(data))


class Verdict(enum.Enum):
    """Why a fetched value is, or is not, served. Values are counter names."""

    OK = "ok"
    ABSENT = "absent"
    BAD_HEADER = "bad_header"  # too short, wrong magic or unknown version
    BAD_LENGTH = "bad_length"  # header length differs from the request or the value's size
    BAD_KEY = "bad_key"  # written under another key
    BAD_CHECKSUM = "bad_checksum"


class KeyNamer:
    """Redis keys for ``(namespace, block key)``.

    Thread-safety: immutable after construction; ``token`` is called from the event loop.
    """

    def __init__(self, prefix: str, token: Callable[[int], str] | None = None) -> None:
        self.prefix = prefix.encode()
        self._token = token
        self._cache: dict[int, bytes] = {}

    def namespace(self, ns: int) -> bytes:
        head = self._cache.get(ns)
        if head is None:
            token = str(ns) if self._token is None else self._token(ns)
            if not _TOKEN_RE.fullmatch(token):
                raise ValueError(
                    f"namespace token {token!r} for namespace {ns} must be 1-128 characters "
                    "of letters, digits, '_', '.', '-'"
                )
            head = self.prefix + token.encode() + b":"
            if len(self._cache) >= _MAX_CACHED_NAMESPACES:
                # Clients choose namespace names freely (each a new id): stay bounded.
                self._cache.clear()
            self._cache[ns] = head
        return head

    def key(self, ns: int, key: bytes) -> bytes:
        return self.namespace(ns) + key.hex().encode()


def header(nbytes: int, sum64: int, redis_key: bytes) -> bytes:
    """The header of a block of ``nbytes`` with checksum ``sum64`` stored under
    ``redis_key``."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0, nbytes, sum64, checksum(redis_key))


def header_length(head: bytes | None, redis_key: bytes) -> int | None:
    """The block length a value's header claims, given the header alone (its first
    ``HEADER_BYTES``, as a probe fetches them): None unless it parses with this magic and
    version, its key tag is ``redis_key``'s and the length is not 0. The rest of the value is
    checked when it is read (``verify``)."""
    if head is None or len(head) != HEADER_BYTES:
        return None
    magic, version, _flags, _res, length, _sum64, key_tag = _HEADER.unpack(head)
    if magic != MAGIC or version != FORMAT_VERSION or length == 0:
        return None
    if key_tag != checksum(redis_key):
        return None
    return int(length)


def verify(value: bytes | None, nbytes: int, redis_key: bytes) -> Verdict:
    """Whether ``value`` (as GET returned it) holds a valid block of ``nbytes`` for
    ``redis_key``; its bytes are then ``memoryview(value)[HEADER_BYTES:]``."""
    if value is None:
        return Verdict.ABSENT
    if len(value) < HEADER_BYTES:
        return Verdict.BAD_HEADER
    magic, version, _flags, _res, length, sum64, key_tag = _HEADER.unpack_from(value, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        return Verdict.BAD_HEADER
    if length != nbytes or len(value) != HEADER_BYTES + length:
        return Verdict.BAD_LENGTH
    if key_tag != checksum(redis_key):
        return Verdict.BAD_KEY
    if checksum(memoryview(value)[HEADER_BYTES:]) != sum64:
        return Verdict.BAD_CHECKSUM
    return Verdict.OK
