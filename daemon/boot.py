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


def boot_id() -> str | None:
    """This boot's id (the kernel's): drive settings last until the next boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def drives_report_path(state_dir: str) -> str:
    """Where `colibrid drives` leaves what it set, for the daemon to report."""
    return os.path.join(state_dir, "drives.json")


def set_up_drives(places: list[str], cpus: list[int], apply: bool) -> list[dict]:
    """The drives under `places` (the model's directory, the copies'): what each is and how
    it queues reads, and with `apply` what setting it up changed (`changed`: each step with
    `done`, or `why` not), else what it would change (`would_change`)."""
    from ..storage.devices import discover, plan, tune

    out = []
    for where in places:
        d = discover(where)
        if apply:
            d["changed"] = tune(d, cpus)
            for step in d["changed"]:
                if step["done"]:
                    log.info("drive %s: %s %s -> %s", d["device"], step["what"], step["from"], step["to"])
                else:
                    log.warning("drive %s: could not set %s to %s: %s", d["device"], step["what"], step["to"],
                                step["why"])
            d |= {k: v for k, v in discover(where).items() if k in ("scheduler", "read_ahead_kb")}
        else:
            d["would_change"] = plan(d, cpus)
        out.append({k: v for k, v in d.items() if k not in ("sysfs", "schedulers")})
    return out


def prepare_drives(places: list[str], cpus: list[int], apply: bool, report: str) -> list[dict]:
    """`colibrid drives`, the unit's privileged ExecStartPre step: set the drives up (with
    `apply`, i.e. `tune_drives: true`) while it may write /sys and /proc/irq, and leave
    the result in `report` for the unprivileged daemon to show. Raises OSError when the
    report cannot be written."""
    import json
    import time

    from ..storage.statefile import write_atomic

    drives = set_up_drives(places, cpus, apply)
    os.makedirs(os.path.dirname(report), exist_ok=True)
    write_atomic(report, json.dumps({"boot_id": boot_id(), "made": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                     "applied": apply, "cpus": cpus, "drives": drives}).encode())
    return drives


def drives_set_at_boot(report: str) -> dict | None:
    """What `colibrid drives` set during this boot (its report), or None: none, or one of
    an earlier boot, or one that cannot be read."""
    import json

    try:
        with open(report) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(got, dict) or got.get("boot_id") != boot_id() or not got.get("applied"):
        return None
    return got
