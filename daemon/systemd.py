"""The two pieces of systemd's service protocol kvtierd speaks: sd_notify and the watchdog.

Both are no-ops unless systemd set NOTIFY_SOCKET (``Type=notify``) and WATCHDOG_USEC.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to systemd; False when not under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as e:
        log.warning("sd_notify to %s failed: %s", address, e)
        return False
    return True


def watchdog_interval_s() -> float | None:
    """How often to ping the watchdog (half its timeout), or None when it is off."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        log.warning("ignoring malformed WATCHDOG_USEC=%r", usec)
        return None
