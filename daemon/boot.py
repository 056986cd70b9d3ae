"""Boot-time placement. Each step returns what was asked, what it got, and, where the box
did not allow it, the fallback and why; colictl status shows them all. Never raises for
a box that cannot do something: it falls back and says so."""

import ctypes
import ctypes.util
import logging
import os
import resource

log = logging.getLogger("colibri.daemon")


def set_cpus(cpus: list[int]) -> dict:
    """CPU affinity of the whole process (threads made later inherit it)."""
    if not cpus:
        return {"asked": "all", "got": sorted(os.sched_getaffinity(0))}
    try:
        os.sched_setaffinity(0, cpus)
        return {"asked": cpus, "got": sorted(os.sched_getaffinity(0))}
    except OSError as e:
        got = sorted(os.sched_getaffinity(0))
        log.warning("CPU affinity %s refused (%s); running on %s", cpus, e.strerror, got)
        return {"asked": cpus, "got": got, "fallback": f"sched_setaffinity refused: {e.strerror}"}


def set_numa(node: int | None) -> dict:
    """Run on NUMA node `node` and prefer its memory, through libnuma where present."""
    if node is None:
        return {"asked": "any", "got": "any"}
    name = ctypes.util.find_library("numa")
    try:
        numa = ctypes.CDLL(name or "libnuma.so.1", use_errno=True)
    except OSError:
        log.warning("NUMA node %d asked but libnuma is not installed; memory policy left as is", node)
        return {"asked": node, "got": "any", "fallback": "libnuma not found (install libnuma1)"}
    if numa.numa_available() < 0:
        return {"asked": node, "got": "any", "fallback": "the kernel reports no NUMA support"}
    if node > numa.numa_max_node():
        return {"asked": node, "got": "any", "fallback": f"no node {node} (nodes 0..{numa.numa_max_node()})"}
    if numa.numa_run_on_node(node) != 0:
        return {"asked": node, "got": "any", "fallback": f"numa_run_on_node failed: {os.strerror(ctypes.get_errno())}"}
    numa.numa_set_preferred(node)
    return {"asked": node, "got": node, "node_cpus": sorted(os.sched_getaffinity(0))}


def lock_arrays(arrays, what: str) -> dict:
    """mlock the memory of numpy arrays (e.g. the dense weights) within RLIMIT_MEMLOCK."""
    total = sum(a.nbytes for a in arrays)
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    libc = ctypes.CDLL(None, use_errno=True)
    locked = 0
    for a in arrays:
        if a.nbytes and libc.mlock(ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(a.nbytes)) == 0:
            locked += a.nbytes
        elif a.nbytes:
            err = os.strerror(ctypes.get_errno())
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
            log.warning("mlock of the %s stopped at %d of %d bytes: %s (RLIMIT_MEMLOCK %s)", what, locked, total,
                        err, limit)
            return {"asked": total, "got": locked,
                    "fallback": f"mlock failed: {err} (RLIMIT_MEMLOCK {limit}; raise LimitMEMLOCK=)"}
    return {"asked": total, "got": locked}
