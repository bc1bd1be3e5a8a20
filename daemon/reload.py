"""SIGHUP: read the config again and apply what can change while the daemon runs.

The new config is loaded exactly as at start (file, ``KVTIER_*`` variables, ``--set``
overrides) and compared key by key with the running one. Keys in ``LIVE`` take effect at once;
any other changed key is listed as needing a restart and keeps its running value, so the
daemon's config always says what it really does. A config that does not load (a bad value, a
broken file), or whose live keys do not pass the config's checks beside the running values of
the others, changes nothing and is logged as an error. Every reload logs one line of what it
applied and one of what needs a restart, sizes in units on both (``64MiB -> 128MiB``). The
user and group names the running config has resolve to the ids they had at start, without
asking the host again (the daemon runs with those ids, and a name since gone from the host
refused every reload); new names are looked up.

Live keys, and how each applies:

- ``policy.protect_s``, ``policy.warmup_s``, ``tiers.*.high_watermark``/``low_watermark``:
  each tier's eviction guard is rebuilt;
- ``tiers.*.read_bytes_s``/``write_bytes_s``: the tier's token buckets take the new rate;
- ``tiers.l3.known_s``: read from the config at each lookup and balancer pass;
- ``policy.readahead_blocks``, ``server.max_batch_blocks``, ``server.lease_default_ms``,
  ``server.lease_max_ms``, ``server.drain_timeout_s``, ``server.stop_grace_s``: read from the
  config on every use;
- ``server.session_ping_s``: for sessions opened from now on;
- ``logging.level``, ``logging.format``: the handler is set up again;
- ``tenants``, ``shared_namespaces`` and ``server.admin_uids``, unless the change turns
  tenants on or off (from none configured to some, or back: that needs a restart, as the
  sessions of the default tenant are counted per uid): who may connect as which tenant,
  which shared namespaces each may use, and the quotas change at once. A tenant added or
  given a new token path has its token file read now (one that cannot be used refuses the
  whole reload); a tenant that keeps its path keeps the token read before (read again below).
  Every open session is bound again as it would be now (``TenantDirectory.rebind``): one
  whose tenant or admin right would differ, or that would be refused (its tenant removed,
  its uid or gid no longer listed, its tenant's token dropped; the token it opened with now
  another tenant's, or more than one's, as when token files move between tenants), ends at
  once with PERMISSION_DENIED saying why, its leases and pools released; its client's next
  call opens a session bound as the tenants are now. Sessions that still bind as before go
  on, and a tenant's access to a shared namespace it lost is refused from its next request.
  A removed tenant's blocks stay (counted under its name, evicted as any other, deletable by
  an admin with ``tenant``) until they are evicted; they come back into its use if it is
  configured again. A tenant above a lowered quota makes room among its own blocks at its
  next put, as at the quota, and keeps what it holds until then.

Token files are read again too, even when the new config does not load or apply (the running
config's tenants' ``token_file`` and ``metrics.token_file``, the paths unchanged): a file
whose content changed gives its tenant (or the metrics endpoint) the new token from then on,
the old one no longer binds a session (sessions already open stay, but those whose token is
now another tenant's, or more than one's, end as above); a file that cannot be used now
(gone, readable by others, too short) is logged and its token stays the one read before;
tenants whose files now hold the same token are logged too (such a token binds none of
them). Tokens are never logged.

Thread-safety: call on the daemon's event loop (the signal handler is installed with
``loop.add_signal_handler``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.daemon.config import Config, check_config, config_keys, ids_from
from kvtier.daemon.errors import ConfigError, PermissionDenied, Unauthenticated
from kvtier.daemon.logs import setup_logging
from kvtier.daemon.policy.guard import EvictionGuard
from kvtier.daemon.sessions import shown_id
from kvtier.daemon.tenants import TenantDirectory, read_token_digests, read_token_file
from kvtier.tiers.sizes import format_size

if TYPE_CHECKING:
    from kvtier.daemon.metrics import MetricsServer
    from kvtier.daemon.server import Daemon

log = logging.getLogger(__name__)

LIVE_PATTERNS = (
    r"policy\.(protect_s|warmup_s|readahead_blocks)",
    r"tiers\.\w+\.(high_watermark|low_watermark|read_bytes_s|write_bytes_s)",
    r"tiers\.l3\.known_s",
    r"server\.(max_batch_blocks|lease_default_ms|lease_max_ms|drain_timeout_s|stop_grace_s|session_ping_s)",
    r"logging\.(level|format)",
)
_LIVE = re.compile("|".join(f"(?:{p})" for p in LIVE_PATTERNS))
# Config lists whose records' quotas are live (the rest of each record needs a restart).
QUOTA_LISTS = ("tenants", "shared_namespaces")
# Who may connect as what: live while tenants stay configured (or stay off).
TENANT_KEYS = (*QUOTA_LISTS, "server.admin_uids")


def is_live(key: str) -> bool:
    return _LIVE.fullmatch(key) is not None


@dataclass(frozen=True, slots=True)
class ReloadReport:
    applied: list[str]  # "key: old -> new"
    needs_restart: list[str]
    error: str = ""
    new_tokens: list[str] = dataclasses.field(default_factory=list)  # "tenant 'x'", "metrics"
    token_problems: list[str] = dataclasses.field(default_factory=list)


def get_key(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def is_size(config: Any, key: str) -> bool:
    """Whether ``key`` (dotted) is a size (``capacity_bytes``, ``read_bytes_s``)."""
    *sections, name = key.split(".")
    for part in sections:
        config = getattr(config, part)
    meta = {f.name: f.metadata for f in dataclasses.fields(config)}[name]
    return bool(meta) and meta["kind"] == "size"


# A string shown bare in a reload line: what YAML reads back as that same string.
_BARE = re.compile(r"[A-Za-z_/][\w./:@+-]*")
_YAML_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "null", "y", "n"})


def shown(value: Any) -> str:
    """A config value as the config file spells it (YAML): ``DEBUG``, ``true``,
    ``[1000, 1001]``, ``""``; a string YAML would read otherwise is quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, str):
        bare = _BARE.fullmatch(value) and value.lower() not in _YAML_WORDS
        return value if bare else json.dumps(value)
    return str(value)


def change(config: Any, key: str, old: Any, new: Any) -> str:
    """``"key: old -> new"`` as the config spells the values: sizes in units (``64MiB``),
    the rest as YAML (``shown``)."""
    if is_size(config, key):
        return f"{key}: {format_size(old)} -> {format_size(new)}"
    return f"{key}: {shown(old)} -> {shown(new)}"


def with_key(config: Any, key: str, value: Any) -> Any:
    head, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(config, **{head: value})
    return dataclasses.replace(config, **{head: with_key(getattr(config, head), rest, value)})


def plan(running: Config, loaded: Config) -> tuple[Config, list[str], list[str]]:
    """(the config to run with, the live changes, the changes that need a restart)."""
    effective = running
    applied: list[str] = []
    restart: list[str] = []
    for key in config_keys():
        old, new = get_key(running, key), get_key(loaded, key)
        if old == new:
            continue
        if is_live(key):
            effective = with_key(effective, key, new)
            applied.append(change(running, key, old, new))
        elif key in TENANT_KEYS and bool(running.tenants) == bool(loaded.tenants):
            effective = with_key(effective, key, new)
            applied += tenant_changes(key, old, new)
        elif key in TENANT_KEYS:
            turned = "on" if loaded.tenants else "off"
            restart.append(f"{'; '.join(tenant_changes(key, old, new))} (turns tenants {turned})")
        else:
            restart.append(change(running, key, old, new))
    return effective, applied, restart


def tenant_changes(key: str, old: Any, new: Any) -> list[str]:
    """What changed in ``server.admin_uids``, or in ``tenants`` or ``shared_namespaces``: a
    line naming the records added, removed or changed in more than their quotas ("tenants:
    added carol; removed bob; changed alice"), left out where only quotas changed, then one
    line per quota that changed of a record kept ("tenants[bob].quotas.l1: 1GiB -> 512MiB";
    0 is no quota, as in the config), sizes as the other changes spell them. A quota
    changed beside other changes of the list is named as when it changes alone, not hidden
    in a "changed" that says nothing of it."""
    if key not in QUOTA_LISTS:
        return [f"{key}: {shown(old)} -> {shown(new)}"]
    before, after = {r.name: r for r in old}, {r.name: r for r in new}
    kept = [n for n in after if n in before]
    quotas = [line for n in kept for line in quota_changes(key, before[n], after[n])]
    parts = []
    for what, names in (
        ("added", [n for n in after if n not in before]),
        ("removed", [n for n in before if n not in after]),
        (
            "changed",
            [n for n in kept if dataclasses.replace(before[n], quotas=after[n].quotas) != after[n]],
        ),
    ):
        if names:
            parts.append(f"{what} {', '.join(names)}")
    if not parts and quotas:
        return quotas
    return [f"{key}: {'; '.join(parts) or 'reordered'}", *quotas]


def quota_changes(key: str, a: Any, b: Any) -> list[str]:
    """One line per tier whose quota differs between two versions of a record of ``key``."""
    out = []
    for tier in dataclasses.fields(a.quotas):
        before, after = getattr(a.quotas, tier.name), getattr(b.quotas, tier.name)
        if before != after:
            out.append(
                f"{key}[{a.name}].quotas.{tier.name}: {format_size(before)} -> {format_size(after)}"
            )
    return out


class Reloader:
    def __init__(
        self,
        daemon: Daemon,
        load: Callable[[], Config],
        known_ids: dict[tuple[str, str], int] | None = None,
        metrics: MetricsServer | None = None,
    ) -> None:
        """``known_ids``: the uids and gids the running config's user and group names
        resolved to at start (``config.ids_from``); a reload resolves those names from it,
        not the host. ``metrics``: the running endpoint, whose token a reload reads again."""
        self.daemon = daemon
        self.load = load
        self.known_ids = known_ids if known_ids is not None else {}
        self.metrics = metrics

    def reload(self) -> ReloadReport:
        # A copy: the names only this reload brings in are not the running config's.
        with ids_from(dict(self.known_ids)):
            report = self._reload()
        # The running config's files: read again whether or not the new config loaded, so
        # that a secret rotated out stops binding even while the config file is wrong.
        new_tokens, problems = self.reread_tokens()
        return dataclasses.replace(report, new_tokens=new_tokens, token_problems=problems)

    def _reload(self) -> ReloadReport:
        try:
            loaded = self.load()
        except ConfigError as e:
            log.error("SIGHUP: config not reloaded, the running one stays: %s", e)
            return ReloadReport([], [], str(e))
        effective, applied, restart = plan(self.daemon.config, loaded)
        try:
            # The live keys change, the others keep their running values: a pair checked
            # together at load (server.max_batch_blocks against server.max_message_bytes) may
            # not hold in that mix, and the daemon would run a config it refuses at start.
            check_config(effective)
        except ConfigError as e:
            log.error(
                "SIGHUP: config not reloaded, the running one stays: with the keys that need "
                "a restart at their running values, the new live ones do not hold: %s",
                e,
            )
            return ReloadReport([], [], str(e))
        directory = None
        if _tenants_of(effective) != _tenants_of(self.daemon.config):
            try:
                # Before anything changes: a token file that cannot be used refuses it all.
                directory = self.daemon.tenants.reloaded(self.daemon.config, effective)
            except OSError as e:
                log.error("SIGHUP: config not reloaded, the running one stays: %s", e)
                return ReloadReport([], [], str(e))
        try:
            self.apply(effective, directory)
        except Exception as e:
            log.exception("SIGHUP: applying the new config failed; the running one stays")
            return ReloadReport([], [], str(e))
        log.info("SIGHUP: applied %s", "; ".join(applied) if applied else "nothing (no change)")
        if restart:
            log.warning(
                "SIGHUP: these changes need a restart and were not applied: %s",
                "; ".join(restart),
            )
        return ReloadReport(applied, restart)

    def end_rebound_sessions(self) -> None:
        """End the open sessions whose binding the tenants as they are now would change or
        refuse (see the module docstring)."""
        daemon = self.daemon
        for session in daemon.sessions.sessions():
            try:
                now = daemon.tenants.rebind(session.peer, session.tenant, session.token_digest)
            except (Unauthenticated, PermissionDenied) as e:
                why = f"the daemon's tenants changed, and this session would now be refused: {e}"
            else:
                if (now.tenant, now.admin, now.limit_key) == (
                    session.tenant,
                    session.admin,
                    session.limit_key,
                ):
                    continue
                admin = " (admin)" if now.admin else ""
                why = (
                    f"the daemon's tenants changed: this session would now be bound to tenant "
                    f"{now.tenant!r}{admin}, not {session.tenant!r}"
                    f"{' (admin)' if session.admin else ''}; open another"
                )
            daemon.servicer.end_session(session.session_id, why)
            log.warning("SIGHUP: session %s ended: %s", shown_id(session.session_id), why)

    def reread_tokens(self) -> tuple[list[str], list[str]]:
        """Read the running config's token files again (see the module docstring); what
        took a new token, and what could not be read."""
        config = self.daemon.config
        digests, problems = read_token_digests(config)
        renewed = self.daemon.tenants.set_tokens(digests)
        if renewed:
            # A token a session opened with may be another tenant's now (files' contents
            # swapped), or more than one's: bound otherwise, those sessions end.
            self.end_rebound_sessions()
        changed = [f"tenant {name!r}" for name in renewed]
        clashes = [
            f"tenants {', '.join(map(repr, names))}: their token files hold the same token, "
            "which binds none of them"
            for names in self.daemon.tenants.token_clashes()
        ]
        if self.metrics is not None and self.metrics.token is not None:
            try:
                token = read_token_file(config.metrics.token_file)
            except OSError as e:
                problems.append(f"metrics: {e}")
            else:
                if token != self.metrics.token and self.metrics.set_token(token):
                    changed.append("metrics")
        if changed:
            log.info("SIGHUP: new token for %s", ", ".join(changed))
        for problem in problems:
            log.error("SIGHUP: token file not read again, its token stays: %s", problem)
        for clash in clashes:
            log.error("SIGHUP: %s; give each its own", clash)
        return changed, problems + clashes

    def apply(self, config: Config, directory: TenantDirectory | None = None) -> None:
        """Make ``config`` (which differs from the running one only in live keys) current;
        ``directory``: its tenants, where they changed (``TenantDirectory.reloaded``)."""
        daemon = self.daemon
        old = daemon.config
        if (config.logging.level, config.logging.format) != (
            old.logging.level,
            old.logging.format,
        ):
            setup_logging(config.logging.level, config.logging.format)
        store = daemon.store
        for level in store.stack:
            section = getattr(config.tiers, level.label.lower(), None)
            high = getattr(section, "high_watermark", level.guard.high_watermark)
            low = getattr(section, "low_watermark", level.guard.low_watermark)
            level.guard = EvictionGuard(config.policy.protect_s, config.policy.warmup_s, high, low)
            if section is not None:
                level.reads.rate = float(getattr(section, "read_bytes_s", level.reads.rate))
                if level.keyed:
                    # Its write budget is the tier's own (see daemon/stack.py).
                    level.keys.set_write_rate(int(section.write_bytes_s))
                else:
                    level.writes.rate = float(getattr(section, "write_bytes_s", level.writes.rate))
        daemon.servicer.ping_interval_s = config.server.session_ping_s
        daemon.config = config
        daemon.service.config = config
        store.config = config
        if directory is not None:
            # After the config: the tenants and the config that names them change together
            # (the token re-read after this reads the new config's tenants' files).
            daemon.tenants.replace_with(directory)
            daemon.service.apply_quotas()
            self.end_rebound_sessions()


def _tenants_of(config: Config) -> tuple[Any, ...]:
    """What a ``TenantDirectory`` is made of."""
    return (config.tenants, config.shared_namespaces, config.server.admin_uids)
