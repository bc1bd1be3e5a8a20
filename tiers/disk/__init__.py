"""L2, the disk tier: ``DiskTier`` (tier.py) over its slot files (files.py), its SQLite index
(index.py), its batch I/O engine (io.py) and its fault state (health.py)."""

from kvtier.tiers.disk.files import FileBackend, OsFiles
from kvtier.tiers.disk.io import checksum
from kvtier.tiers.disk.tier import CHECKSUM_NAME, DiskTier, ReadItem

__all__ = [
    "CHECKSUM_NAME",
    "DiskTier",
    "FileBackend",
    "OsFiles",
    "ReadItem",
    "checksum",
]
