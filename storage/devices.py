"""The drives the experts stream from: which block device holds a file, how the kernel
queues reads to it, and (when asked) setting it up for colibri's reads.

Discovery follows what the kernel shows in sysfs: a file's st_dev names a block device
(/sys/dev/block/MAJOR:MINOR); a partition is read through its disk, a device-mapper
volume (LVM, dm-crypt) through the devices under it (slaves/), a loop device says which
file backs it. A file on a virtual file system (tmpfs, overlay without a device) has no
block device, and discovery says so rather than guessing.

Set-up (`tune_drives: true`), each step reported with what it was and what it became, or
why it could not be done:
- the I/O scheduler to `none`: an NVMe drive serves many queues itself, and colibri's
  reads are already large, aligned and batched; a scheduler only adds latency;
- read-ahead to READ_AHEAD_KB: O_DIRECT reads never use it, and the page-cache reads that
  remain (the dense file at load, buffered fallbacks) are sequential or whole records,
  so megabytes of speculative read-ahead (8 MiB is common) only evict useful pages;
- the device's interrupts (its MSI vectors) to the CPUs the daemon runs on, so a read's
  completion lands on a CPU of its NUMA node. Kernel-managed vectors (NVMe's, usually)
  refuse a new affinity: that is reported, not an error.
Nothing is restored at stop: the settings stay until the next boot (or until changed), and
`colictl status` and `colictl doctor` show them.
"""

import os

READ_AHEAD_KB = 128  # the kernel's own default, against the 8 MiB some distributions set


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _int(path: str) -> int | None:
    v = _read(path)
    return int(v) if v is not None and v.lstrip("-").isdigit() else None


def discover(path: str) -> dict:
    """What holds `path`: {"path", "device", "via", "model", "nr_requests", "scheduler",
    "schedulers", "read_ahead_kb", "rotational", "irqs", "backing_file"} (device None, and
    "why", when there is no block device to show). Never raises for what sysfs lacks."""
    out: dict = {"path": path, "device": None}
    try:
        dev = os.stat(path).st_dev
    except OSError as e:
        return out | {"why": f"cannot stat it ({e.strerror})"}
    major, minor = os.major(dev), os.minor(dev)
    node = f"/sys/dev/block/{major}:{minor}"
    if major == 0 or not os.path.exists(node):
        return out | {"why": "on a file system without a block device (tmpfs, overlay, network): nothing to set up"}
    sys = os.path.realpath(node)
    via = []
    if os.path.exists(os.path.join(sys, "partition")):
        via.append(f"{os.path.basename(sys)} (partition)")
        sys = os.path.dirname(sys)
    name = os.path.basename(sys)
    slaves = sorted(os.listdir(os.path.join(sys, "slaves"))) if os.path.isdir(os.path.join(sys, "slaves")) else []
    if name.startswith("dm-") and slaves:  # device-mapper: report the first device under it, name them all
        via.append(f"{name} ({_read(os.path.join(sys, 'dm', 'name')) or 'device-mapper'} over {', '.join(slaves)})")
        under = os.path.realpath(os.path.join(sys, "slaves", slaves[0]))
        if os.path.exists(os.path.join(under, "partition")):
            via.append(f"{os.path.basename(under)} (partition)")
            under = os.path.dirname(under)
        sys, name = under, os.path.basename(under)
    q = os.path.join(sys, "queue")
    sched = _read(os.path.join(q, "scheduler")) or ""
    active = next((s[1:-1] for s in sched.split() if s.startswith("[")), sched or None)
    model = _read(os.path.join(sys, "device", "model")) or _read(os.path.join(sys, "device", "vendor"))
    out |= {"device": name, "sysfs": sys, "via": via, "model": model or None,
            "nr_requests": _int(os.path.join(q, "nr_requests")), "scheduler": active,
            "schedulers": [s.strip("[]") for s in sched.split()],
            "read_ahead_kb": _int(os.path.join(q, "read_ahead_kb")),
            "rotational": bool(_int(os.path.join(q, "rotational"))), "irqs": device_irqs(sys),
            "backing_file": _read(os.path.join(sys, "loop", "backing_file"))}
    return out


def device_irqs(sys: str) -> list[int]:
    """The MSI interrupt vectors of the device behind a block device (its PCI function's
    msi_irqs, a few levels up from device/); none for loop, dm and virtual devices."""
    d = os.path.join(sys, "device")
    if not os.path.exists(d):
        return []
    d = os.path.realpath(d)
    for _ in range(4):
        msi = os.path.join(d, "msi_irqs")
        if os.path.isdir(msi):
            return sorted(int(n) for n in os.listdir(msi) if n.isdigit())
        d = os.path.dirname(d)
    return []


def plan(drive: dict, cpus: list[int]) -> list[dict]:
    """The changes tune() would make: {"what", "from", "to", "file"} each."""
    if drive.get("device") is None:
        return []
    q = os.path.join(drive["sysfs"], "queue")
    steps = []
    if "none" in drive["schedulers"] and drive["scheduler"] != "none":
        steps.append({"what": "scheduler", "from": drive["scheduler"], "to": "none",
                      "file": os.path.join(q, "scheduler")})
    if drive["read_ahead_kb"] is not None and drive["read_ahead_kb"] > READ_AHEAD_KB:
        steps.append({"what": "read_ahead_kb", "from": drive["read_ahead_kb"], "to": READ_AHEAD_KB,
                      "file": os.path.join(q, "read_ahead_kb")})
    want = ",".join(map(str, sorted(cpus)))
    for irq in drive["irqs"]:
        f = f"/proc/irq/{irq}/smp_affinity_list"
        now = _read(f)
        if now is not None and cpu_set(now) != set(cpus):
            steps.append({"what": f"irq {irq} affinity", "from": now, "to": want, "file": f})
    return steps


def tune(drive: dict, cpus: list[int]) -> list[dict]:
    """Make plan()'s changes; each step comes back with "done": True, or "done": False and
    "why". Never raises."""
    out = []
    for step in plan(drive, cpus):
        try:
            with open(step["file"], "w") as f:
                f.write(str(step["to"]))
            out.append(step | {"done": True})
        except OSError as e:
            why = e.strerror or str(e)
            if step["what"].startswith("irq") and e.errno == 5:  # EIO: the kernel manages this vector's affinity
                why = "a kernel-managed interrupt (its affinity is the kernel's)"
            out.append(step | {"done": False, "why": why})
    return out


def cpu_set(text: str) -> set[int]:
    """'0-3,8' -> {0, 1, 2, 3, 8}."""
    got: set[int] = set()
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            got |= set(range(int(a), int(b) + 1))
        elif part.strip():
            got.add(int(part))
    return got
