"""systemd's notify protocol (READY=1, STATUS=, WATCHDOG=1, STOPPING=1). Never raises and
never blocks: outside systemd (no NOTIFY_SOCKET) every call is a no-op.

The datagram is sent here with MSG_DONTWAIT rather than through systemd-python's
sd_notify, which blocks when the receiver's queue is full: the caller is the I/O thread,
and a stalled notify socket must not stall every client.
"""

import logging
import os
import socket

log = logging.getLogger("colibri.daemon")


def notify(*lines: str) -> bool:
    """Send `lines` (e.g. "READY=1", "STATUS=loading") to $NOTIFY_SOCKET; True if sent."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    addr = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, addr)
        return True
    except OSError as e:
        log.debug("sd_notify failed: %s", e)
        return False


def watchdog_interval_s(configured: float) -> float:
    """Seconds between WATCHDOG=1 pings: the configured value, else half of systemd's
    WATCHDOG_USEC, else 0 (no watchdog)."""
    if configured > 0:
        return configured
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if usec and (not pid or pid == str(os.getpid())):
        try:
            return int(usec) / 2e6
        except ValueError:
            return 0.0
    return 0.0
