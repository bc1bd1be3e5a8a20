"""``kvtierd``: run the daemon."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import yaml

from kvtier import __version__
from kvtier.daemon.config import load_config
from kvtier.daemon.errors import ConfigError
from kvtier.daemon.logs import setup_logging

log = logging.getLogger("kvtier.daemon")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvtierd", description="Tiered KV-cache storage daemon for LLM inference."
    )
    p.add_argument(
        "--config", metavar="FILE", help="YAML config; without it the embedded defaults apply"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=[],
        help="override one config value (repeatable), e.g. --set tiers.l1.capacity_bytes=4GiB",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the effective config and exit"
    )
    p.add_argument("--check-config", action="store_true", help="validate the config and exit")
    p.add_argument("--version", action="version", version=f"kvtierd {__version__}")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"kvtierd: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        yaml.safe_dump(config.as_dict(), sys.stdout, sort_keys=False)
        return 0
    if args.check_config:
        print("config ok")
        return 0
    setup_logging(config.logging.level, config.logging.format)
    from kvtier.daemon.server import serve  # heavy imports after the config is known good

    def ready(daemon: object) -> None:
        addresses = ", ".join(getattr(daemon, "addresses", []))
        print(f"kvtierd {__version__} listening on {addresses}", flush=True)

    from kvtier.tiers.base import TierError

    try:
        asyncio.run(serve(config, on_ready=ready))
    except (OSError, TierError) as e:
        log.error("cannot start: %s", e)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
