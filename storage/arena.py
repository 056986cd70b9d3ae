"""The expert arena: one anonymous mapping per budget, cut into record-sized slots.

Page aligned (so O_DIRECT reads land in it), on the reserved 2 MiB hugepages when asked
and the pool holds it, else transparent hugepages asked for with madvise; every page
made at allocation (the arena is the budget, so RSS is what was asked for); mlock'ed
when asked and the limit allows. Nothing is allocated per read.
"""

import logging
import mmap
import os
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("colibri.storage")
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's value; Python 3.11 lacks the name
MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)  # likewise
HUGEPAGE = 2 * 2**20


def meminfo(key: str) -> int:
    """A /proc/meminfo field (kB; HugePages_* are page counts), 0 when absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class Arena:
    mm: mmap.mmap
    slots: np.ndarray  # [n_slots, slot_bytes] uint8
    hugepages: str  # what the mapping got, said for status
    mlock: str

    def close(self) -> None:
        """Unmap, unless a view of it is still alive somewhere (the GC unmaps it later)."""
        try:
            self.mm.close()
        except BufferError:
            pass


def allocate(n_slots: int, slot_bytes: int, hugetlb: bool = False, mlock: bool = False) -> Arena:
    """An arena of `n_slots` slots of `slot_bytes`. What it could not get (reserved
    hugepages, mlock) it says in `hugepages` / `mlock` and goes on without.
    Raises OSError when even a plain mapping fails."""
    n_bytes = n_slots * slot_bytes
    mm, said = (_reserved_hugepages(n_bytes) if hugetlb else (None, ""))
    if mm is None:
        mm = mmap.mmap(-1, n_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        thp = _transparent_hugepages(mm)
        said = f"{thp}; {said}" if hugetlb else thp
    slots = np.frombuffer(mm, np.uint8)[:n_bytes].reshape(n_slots, slot_bytes)  # [slots, slot_bytes]
    # make every page now: a first read into a fresh page costs a fault and halves early read
    # bandwidth. MADV_POPULATE_WRITE (Linux 5.14) does it in the kernel, 25x faster than
    # touching each page from here.
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except OSError:
        slots.reshape(-1)[:: mmap.PAGESIZE] = 0
    return Arena(mm, slots, said, _mlock(mm) if mlock else "not asked")


def _reserved_hugepages(n_bytes: int) -> tuple[mmap.mmap | None, str]:
    """A mapping on the reserved 2 MiB hugepages, or None and why the pool cannot hold it."""
    size = -(-n_bytes // HUGEPAGE) * HUGEPAGE
    try:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB)
    except OSError as e:
        why = (f"fallback from reserved hugepages: {e.strerror}; {meminfo('HugePages_Free')} free of 2 MiB, "
               f"{size // HUGEPAGE} needed (sysctl vm.nr_hugepages)")
        log.warning("expert arena: %s", why)
        return None, why
    return mm, f"reserved ({size // HUGEPAGE} x 2 MiB)"


THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str | None:
    """The kernel's transparent hugepage setting (always, madvise, never), or None."""
    try:
        with open(THP_SETTING) as f:
            text = f.read()
    except OSError:
        return None
    return next((w[1:-1] for w in text.split() if w.startswith("[")), None)


def _transparent_hugepages(mm: mmap.mmap) -> str:
    """Ask for transparent hugepages and say what the kernel's setting gives the arena."""
    mode = thp_mode()
    if mode is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "transparent hugepages not available (no THP in this kernel)"
    if mode == "never":
        return f"no hugepages: transparent hugepages are off ({THP_SETTING}: never)"
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError as e:
        return f"transparent hugepages refused: {e.strerror}"
    return f"transparent ({mode})"


def _mlock(buf: mmap.mmap) -> str:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(len(buf))) != 0:
        return f"mlock failed: {os.strerror(ctypes.get_errno())} (raise RLIMIT_MEMLOCK / LimitMEMLOCK=)"
    return "locked"
