"""Storage faults on demand, for tests and for drills: EIO, short reads and corrupted
bytes on chosen experts, injected into the expert cache's reads.

Enabled only by tests (ExpertCache(faults=...)) or by the documented debug setting
`COLIBRI_FAULTS` in the daemon's or colictl's environment, never by a config file:

    COLIBRI_FAULTS="eio@3:17,short@3:18x1,corrupt@4:2,eio@drive1:4:2"

Each item is KIND@LAYER:EXPERT[xCOUNT]: KIND is `eio` (the read fails with EIO),
`short` (the file ends in the middle of the record), `corrupt` (bytes of the record
come back flipped) or `stall` (the read hangs STALL_S seconds, then succeeds: a drive
that stops answering for a while, which the daemon's watchdog must notice); COUNT is how many reads fail before the expert reads cleanly
(default: every read). `@driveN:` targets the copy on drive N (drives.py; `@mirror:` is
drive 1) instead of the container's own (drive 0).
"""

import errno
import re
import time
from dataclasses import dataclass

from .errors import ColibriError

KINDS = ("eio", "short", "corrupt", "stall")
STALL_S = 3.0


class FaultSpecInvalid(ColibriError):
    """COLIBRI_FAULTS cannot be parsed."""


@dataclass
class Fault:
    kind: str
    left: int | None  # reads still to fail; None: every read


class FaultPlan:
    """Which reads fail, and how. Thread-safe enough for the cache's I/O pool: a count
    may be consumed twice by two racing reads, which only makes a drill harsher."""

    def __init__(self, faults: dict[tuple[int, int, int], Fault]):  # (drive, layer, expert) -> fault
        self.faults = faults

    @classmethod
    def parse(cls, text: str | None) -> "FaultPlan | None":
        """Raises FaultSpecInvalid naming the bad item."""
        if not text:
            return None
        faults = {}
        for item in text.split(","):
            m = re.fullmatch(r"\s*(\w+)@(?:(mirror|drive(\d+)):)?(\d+):(\d+)(?:x(\d+))?\s*", item)
            if not m or m.group(1) not in KINDS:
                raise FaultSpecInvalid(f"COLIBRI_FAULTS: {item!r} is not KIND@[driveN:]LAYER:EXPERT[xCOUNT] with KIND "
                                       f"one of {', '.join(KINDS)}")
            where = int(m.group(3)) if m.group(3) else 1 if m.group(2) else 0
            faults[(where, int(m.group(4)), int(m.group(5)))] = Fault(m.group(1),
                                                                     int(m.group(6)) if m.group(6) else None)
        return cls(faults)

    def take(self, where: int, layer: int, expert: int) -> str | None:
        """The fault of this read from drive `where`, if any (and count it)."""
        f = self.faults.get((where, layer, expert))
        if f is None or f.left == 0:
            return None
        if f.left is not None:
            f.left -= 1
        return f.kind


def inject(kind: str, buf, done: int) -> int | None:
    """Apply a fault to one read of `buf` (already filled). Returns the byte count the
    read should report (None: as read); raises OSError(EIO) for `eio`."""
    if kind == "eio":
        raise OSError(errno.EIO, "Input/output error (injected)")
    if kind == "short":
        return 0  # the file seems to end here
    if kind == "stall":
        time.sleep(STALL_S)
        return None
    if kind == "corrupt":
        n = len(buf)
        for i in range(0, n, max(n // 7, 1)):
            buf[i] ^= 0x5A
    return None
