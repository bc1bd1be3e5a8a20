"""Daemon configuration: embedded defaults, a YAML file, and ``section.key=value`` overrides.

The defaults are the dataclass defaults below; ``deploy/kvtier.yaml`` spells every one of them
out (a test keeps the two equal). Loading is strict: an unknown key, a value of the wrong type
or out of range stops the daemon with a ConfigError that names the key. Relative paths are
relative to the daemon's working directory.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvtier.daemon.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    None: 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``"64MiB"`` or ``"1.5GB"``."""
    if isinstance(value, bool):
        raise ValueError("expected a size, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            unit = m.group(2).lower() if m.group(2) else None
            return int(float(m.group(1)) * _SIZE_UNITS[unit])
    raise ValueError(f"expected a size such as 1073741824 or '1GiB', got {value!r}")


def _opt(
    kind: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    choices: tuple[str, ...] | None = None,
    doc: str = "",
) -> dict[str, Any]:
    return {"kind": kind, "lo": lo, "hi": hi, "choices": choices, "doc": doc}


@dataclass(frozen=True)
class ServerConfig:
    socket: str = field(
        default="var/kvtierd.sock",
        metadata=_opt("str", doc="Unix socket path of the gRPC API; empty disables it"),
    )
    tcp_address: str = field(
        default="",
        metadata=_opt("str", doc="host:port for gRPC over TCP; empty (the default) disables TCP"),
    )
    max_batch_blocks: int = field(default=4096, metadata=_opt("int", lo=1, hi=1 << 20))
    max_message_bytes: int = field(default=64 << 20, metadata=_opt("size", lo=1 << 20, hi=1 << 31))
    lease_default_ms: int = field(default=30_000, metadata=_opt("int", lo=1))
    lease_max_ms: int = field(default=600_000, metadata=_opt("int", lo=1))
    session_ping_s: int = field(default=10, metadata=_opt("int", lo=1, hi=3600))
    copy_threads: int = field(default=2, metadata=_opt("int", lo=1, hi=64))
    shm_dir: str = field(
        default="/dev/shm", metadata=_opt("str", doc="where POSIX shared-memory objects live")
    )
    drain_timeout_s: float = field(default=10.0, metadata=_opt("float", lo=0))

    def check(self) -> None:
        if not self.socket and not self.tcp_address:
            raise ConfigError(
                "server.socket and server.tcp_address are both empty: nothing to listen on"
            )
        if self.lease_default_ms > self.lease_max_ms:
            raise ConfigError("server.lease_default_ms exceeds server.lease_max_ms")


def _tier_policy() -> Any:
    return field(
        default="",
        metadata=_opt("str", doc="this tier's eviction policy; empty takes policy.name"),
    )


def _rate(what: str) -> Any:
    return field(
        default=0,
        metadata=_opt("size", lo=0, doc=f"bandwidth limit of {what}, bytes/s; 0 is unlimited"),
    )


def _check_tier(label: str, tier: Any) -> None:
    if tier.segment_bytes % 4096:
        raise ConfigError(f"tiers.{label}.segment_bytes must be a multiple of 4096")
    if tier.capacity_bytes < tier.segment_bytes:
        raise ConfigError(
            f"tiers.{label}.capacity_bytes is smaller than tiers.{label}.segment_bytes"
        )
    if tier.low_watermark > tier.high_watermark:
        raise ConfigError(f"tiers.{label}.low_watermark exceeds tiers.{label}.high_watermark")
    if tier.policy:
        _check_policy(f"tiers.{label}.policy", tier.policy)


def _check_policy(key: str, name: str) -> None:
    from kvtier.daemon.policy.registry import policy_names

    live = policy_names(live=True)
    if name not in live:
        raise ConfigError(f"config key '{key}': {name!r} is not one of {', '.join(live)}")


@dataclass(frozen=True)
class L1Config:
    capacity_bytes: int = field(default=1 << 30, metadata=_opt("size", lo=1 << 20))
    segment_bytes: int = field(
        default=64 << 20,
        metadata=_opt("size", lo=4096, doc="slab segment; also the largest block the tier takes"),
    )
    high_watermark: float = field(default=0.95, metadata=_opt("float", lo=0.05, hi=1.0))
    low_watermark: float = field(default=0.90, metadata=_opt("float", lo=0.0, hi=1.0))
    pin_memory: str = field(default="auto", metadata=_opt("str", choices=("auto", "true", "false")))
    policy: str = _tier_policy()

    def check(self) -> None:
        _check_tier("l1", self)


@dataclass(frozen=True)
class L2Config:
    enabled: bool = field(default=False, metadata=_opt("bool", doc="run the disk tier"))
    path: str = field(
        default="var/l2", metadata=_opt("str", doc="directory of the data files and index")
    )
    capacity_bytes: int = field(default=8 << 30, metadata=_opt("size", lo=1 << 20))
    segment_bytes: int = field(default=64 << 20, metadata=_opt("size", lo=4096))
    file_bytes: int = field(
        default=4 << 30, metadata=_opt("size", lo=4096, doc="size of each preallocated data file")
    )
    io_threads: int = field(default=4, metadata=_opt("int", lo=1, hi=64))
    direct_io: bool = field(
        default=True,
        metadata=_opt("bool", doc="O_DIRECT where the filesystem allows; buffered I/O elsewhere"),
    )
    admission: str = field(
        default="",
        metadata=_opt(
            "str",
            doc="which blocks L2 takes: always, second_hit, tinylfu; empty = second_hit for "
            "selective, else the eviction policy's default",
        ),
    )
    write_policy: str = field(
        default="write_back",
        metadata=_opt("str", choices=("write_back", "write_through", "selective")),
    )
    high_watermark: float = field(default=0.95, metadata=_opt("float", lo=0.05, hi=1.0))
    low_watermark: float = field(default=0.90, metadata=_opt("float", lo=0.0, hi=1.0))
    flush_on_stop: bool = field(
        default=True,
        metadata=_opt("bool", doc="on SIGTERM, write every block only in L1 to L2 before exiting"),
    )
    enospc_retry_s: float = field(default=30.0, metadata=_opt("float", lo=0.1))
    read_bytes_s: int = _rate("reads from this tier")
    write_bytes_s: int = _rate("writes into this tier")
    policy: str = _tier_policy()

    def check(self) -> None:
        _check_tier("l2", self)
        if self.enabled and not self.path:
            raise ConfigError("tiers.l2.path is empty")
        from kvtier.daemon.policy.admission import admission_names

        usable = [n for n in admission_names() if n != "belady"]  # belady needs the future
        if self.admission and self.admission not in usable:
            raise ConfigError(
                f"config key 'tiers.l2.admission': {self.admission!r} is not one of "
                f"{', '.join(usable)}"
            )


@dataclass(frozen=True)
class TiersConfig:
    """One subsection per tier kind, fastest first. L1 always runs; the others when enabled."""

    l1: L1Config = field(default_factory=L1Config)
    l2: L2Config = field(default_factory=L2Config)

    def check(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).check()


@dataclass(frozen=True)
class MoverConfig:
    workers: int = field(
        default=2,
        metadata=_opt("int", lo=1, hi=64, doc="background transfers that may run at once"),
    )
    batch_blocks: int = field(
        default=32,
        metadata=_opt("int", lo=1, hi=4096, doc="most blocks in one background transfer"),
    )
    balance_interval_s: float = field(
        default=0.1, metadata=_opt("float", lo=0.001, hi=60, doc="how often watermarks are checked")
    )

    def check(self) -> None:
        pass


@dataclass(frozen=True)
class PolicyConfig:
    name: str = field(
        default="heat",
        metadata=_opt("str", doc="eviction policy by name (heat, density, lru, arc)"),
    )
    protect_s: float = field(
        default=2.0,
        metadata=_opt(
            "float", lo=0, doc="a block just written or read is not evicted for this long"
        ),
    )
    warmup_s: float = field(
        default=0.0,
        metadata=_opt("float", lo=0, doc="after start, evict only at the hard capacity limit"),
    )
    readahead_blocks: int = field(
        default=4,
        metadata=_opt(
            "int", lo=0, hi=1024, doc="reading block i of a chain prefetches i+1..i+k from L2"
        ),
    )
    half_life_s: float = field(
        default=30.0,
        metadata=_opt("float", lo=0.001, doc="heat half-life: how fast past accesses fade"),
    )

    def check(self) -> None:
        _check_policy("policy.name", self.name)


@dataclass(frozen=True)
class LoggingConfig:
    level: str = field(
        default="INFO", metadata=_opt("str", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    )
    format: str = field(default="text", metadata=_opt("str", choices=("text", "json")))

    def check(self) -> None:
        pass


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    mover: MoverConfig = field(default_factory=MoverConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """The effective config: defaults, then the file, then ``section.key=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
        raw = loaded or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        path_parts = key.strip().split(".")
        if not sep or len(path_parts) < 2 or not all(path_parts):
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        node = raw
        for depth, part in enumerate(path_parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"'{'.'.join(path_parts[: depth + 1])}' must be a mapping")
        node[path_parts[-1]] = yaml.safe_load(value) if value.strip() else ""
    return build_config(raw)


# Sections that moved; naming the new place beats "unknown section".
_MOVED = {"l1": "tiers.l1", "l2": "tiers.l2"}


def build_config(raw: dict[str, Any]) -> Config:
    for old, new in _MOVED.items():
        if old in raw:
            raise ConfigError(f"config section '{old}' is now '{new}' (see deploy/kvtier.yaml)")
    config = _build_section("", Config, raw)
    for f in dataclasses.fields(Config):
        getattr(config, f.name).check()
    return config


def _is_section(f: dataclasses.Field[Any]) -> bool:
    factory = f.default_factory
    return factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory)


def _build_section(section: str, cls: Any, values: Any) -> Any:
    """Build ``cls`` from a mapping; fields that are dataclasses are nested sections."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"config section '{section}' must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        where = f"{section}.{key}" if section else str(key)
        if key not in fields:
            what = "key" if section else "section"
            raise ConfigError(f"unknown config {what} '{where}'; known: {', '.join(fields)}")
        f = fields[key]
        if _is_section(f):
            kwargs[key] = _build_section(where, f.default_factory, value)
        elif not f.metadata:
            raise ConfigError(f"config key '{where}' must be a mapping of keys")
        else:
            kwargs[key] = _coerce(where, value, f.metadata)
    return cls(**kwargs)


def _coerce(where: str, value: Any, meta: Any) -> Any:
    kind = meta["kind"]
    try:
        if kind == "size":
            out: Any = parse_size(value)
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"expected an integer, got {value!r}")
            out = value
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"expected a number, got {value!r}")
            out = float(value)
        elif kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"expected true or false, got {value!r}")
            out = value
        elif kind == "str":
            if (
                isinstance(value, bool)
                and meta["choices"]
                and str(value).lower() in meta["choices"]
            ):
                value = str(value).lower()
            if not isinstance(value, str):
                raise ValueError(f"expected a string, got {value!r}")
            out = value
        else:
            raise AssertionError(f"unknown option kind {kind}")
    except ValueError as e:
        raise ConfigError(f"config key '{where}': {e}") from None
    if meta["choices"] is not None and out not in meta["choices"]:
        raise ConfigError(
            f"config key '{where}': {out!r} is not one of {', '.join(meta['choices'])}"
        )
    if meta["lo"] is not None and out < meta["lo"]:
        raise ConfigError(f"config key '{where}': {out} is below the minimum {meta['lo']}")
    if meta["hi"] is not None and out > meta["hi"]:
        raise ConfigError(f"config key '{where}': {out} is above the maximum {meta['hi']}")
    return out
