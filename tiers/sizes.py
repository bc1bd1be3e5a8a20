"""Sizes as the config spells them, and counts as sentences spell them, for messages of the
daemon, its tiers (which may not import the daemon's config) and the CLI."""

from __future__ import annotations

# Prefix powers of 1024 (binary, ``KiB``) and of 1000 (decimal, ``KB``).
POWERS = {"K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def format_size(nbytes: int) -> str:
    """The shortest exact spelling of a size that the config's ``parse_size`` reads back:
    ``"1GiB"``, ``"2GB"``, ``"1000"``."""
    for power, prefix in sorted(((p, k) for k, p in POWERS.items()), reverse=True):
        if nbytes and nbytes % (1 << (10 * power)) == 0:
            return f"{nbytes >> (10 * power)}{prefix}iB"
        if nbytes and nbytes % (10 ** (3 * power)) == 0:
            return f"{nbytes // 10 ** (3 * power)}{prefix}B"
    return str(nbytes)


def counted(n: int, noun: str, nouns: str = "", spec: str = "") -> str:
    """``n`` and ``noun`` for a count of 1, else ``nouns`` (``noun`` and "s" unless given):
    ``counted(1, "block")`` is "1 block", ``counted(0, "block")`` "0 blocks". The nouns may
    be whole phrases whose verb agrees (``"block holds"``, ``"blocks hold"``); ``spec``
    formats ``n`` (``","``: "1,024 keys")."""
    return f"{n:{spec}} {noun if n == 1 else nouns or noun + 's'}"
