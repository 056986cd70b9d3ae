"""The read path against the drive (issue 24): the preadv pool against io_uring at several
queue depths, coalesced reads off and on, on the decode benchmark's model at a 10 %
expert budget, cold.

    python bench/drives.py [--expert-gb 2] [--budget 0.1] [--tokens 24] [--prompt-tokens 24]
                           [--depths 8,32,64] [--two-drives [--drive-mbs 300]]

Each configuration decodes the same sampled tokens (bench/decode.py's run: temperature 1,
fixed seed) from a dropped page cache and an empty expert cache; per configuration: tok/s,
time to first token, expert bytes read per token, read requests per token, the reads'
effective GB/s (bytes over the time reads were in flight), and io_floor_ratio: the time
the drive's own O_DIRECT bandwidth (measured in the same run, the best of several
measurements around the runs) needs for those bytes, over the run's time.

`--two-drives` (root: loop devices and the blkio controller) compares one drive with two:
the container on an ext4 loop device and a staged copy of its expert files on a second,
each throttled to --drive-mbs by `blkio.throttle.read_bps_device` (two drives of equal
bandwidth, each slower than the disk under them), and the container with a copy in another
directory of the same disk (two "drives" that share one). Two figures each: the drives'
read bandwidth through the expert reader with a wave of records in flight (the ratio of
two to one is the issue's target, >= 1.7), and the same decode as above, whose reads come
a layer's misses at a time.
(The co-activation layout's figures are bench/layout.py's.)
"""

import argparse
import contextlib
import json
import os
import shutil
import sys

for var, val in {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}.items():
    os.environ.setdefault(var, val)  # before numpy loads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import numpy as np  # noqa: E402
import provenance  # noqa: E402
from decode import disk_gbs, drop_caches, run  # noqa: E402
from loopdrives import Unavailable, loop_file_system, throttled  # noqa: E402
from synthetic import build, load_model, prompt  # noqa: E402

from colibri.engine import layers  # noqa: E402
from colibri.storage.container import open_container  # noqa: E402
from colibri.storage.staging import stage  # noqa: E402
from colibri.storage.uring import usable  # noqa: E402


def one(path: str, budget: int, ids, a, name: str, **placement) -> dict:
    cold = drop_caches()
    model = load_model(path, budget=budget, io_threads=a.io_threads, **placement)
    r = run(model, ids, a.tokens, seed=1)
    st = r["st"]
    d = model.experts.describe()
    drives = model.experts.drives()
    model.experts.close()
    n_tok = len(ids) + r["n"] - 1
    shares = [{"path": x["path"], "share": x["share"], "measured_gbs": x["measured_gbs"], "gbs": x["gbs"],
               "latency_ms_p50": x["latency_ms_p50"], "latency_ms_p99": x["latency_ms_p99"]}
              for x in drives] if len(drives) > 1 else None
    return {"config": name, **({"drives": shares} if shares else {}), "reader": d["reader"], "records_per_read": d["records_per_read"],
            "queue_depth": d.get("queue_depth"), "cold": cold, "tok_s": round((r["n"] - 1) / r["stats"]["decode_s"], 3),
            "ttft_s": round(r["ttft_s"], 3), "bytes_read_per_token": int(st.bytes_read / n_tok),
            "read_requests_per_token": round(st.read_requests / n_tok, 2),
            "bytes_per_request": int(st.bytes_read / st.read_requests) if st.read_requests else None,
            "read_gbs": round(st.bytes_read / st.io_wall_s / 1e9, 3) if st.io_wall_s else None,
            "io_wait_s": round(st.io_wait_s, 3), "wall_s": round(r["wall_s"], 3), "bytes_read": st.bytes_read}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "colibri", "bench"))
    ap.add_argument("--expert-gb", type=float, default=2.0)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--depths", default="8,32,64")
    ap.add_argument("--two-drives", action="store_true", help="one drive against two (root: loop devices)")
    ap.add_argument("--drive-mbs", type=float, default=300.0, help="--two-drives: each loop drive's read throttle")
    a = ap.parse_args()
    path = build(a.workdir, a.expert_gb)
    layers.init()
    probe = load_model(path, budget="min")
    c = probe.experts.c
    run(probe, prompt(np.random.default_rng(7), 4), 2)  # the kernels compiled before any timing
    probe.experts.close()
    budget = int(c.expert_bytes * a.budget)
    ids = prompt(np.random.default_rng(7), a.prompt_tokens)
    if a.two_drives:
        return two_drives(a, path, budget, ids)
    configs = [("preadv, one record a read", {"coalesce": False}), ("preadv, adjacent records coalesced", {})]
    why = usable()
    if why is None:
        configs += [(f"io_uring depth {q}", {"reader": "io_uring", "queue_depth": q})
                    for q in map(int, a.depths.split(","))]
    disk = [disk_gbs(c, a.io_threads), disk_gbs(c, 4)]
    rows = []
    for name, placement in configs:
        rows.append(one(path, budget, ids, a, name, **placement))
        disk.append(disk_gbs(c, a.io_threads))
        print(json.dumps(rows[-1]), file=sys.stderr)
    best = max(disk + [r["read_gbs"] or 0 for r in rows])
    for r in rows:
        r["io_floor_ratio"] = round(r.pop("bytes_read") / (best * 1e9) / r["wall_s"], 3)
    print(provenance.dumps({"benchmark": "drives", "container": path, "n_layer": len(c.moe_layers),
                      "record_bytes": c.record_bytes, "budget_fraction": a.budget, "budget_bytes": budget,
                      "tokens": a.tokens, "prompt_tokens": a.prompt_tokens, "io_threads": a.io_threads,
                      "disk_odirect_gbs": round(best, 3), "disk_measurements_gbs": [round(x, 3) for x in disk],
                      "io_uring": why or "usable", "results": rows}, indent=2))


def reader_gbs(path: str, drives=(), io_threads: int = 2, n_bytes: int = 768 << 20, wave: int = 32) -> dict:
    """The read bandwidth of the drives themselves, through the expert reader: records in
    file order (those after the first n_bytes' worth skipped), `wave` in flight at a time
    (as a prompt's union or a cache warm-up submits them), from a dropped page cache."""
    import mmap
    import time

    from colibri.storage.experts import ExpertStats
    from colibri.storage.reader import ExpertReader

    drop_caches()
    c = open_container(path)
    r = ExpertReader(c, ExpertStats(), io_threads, drives=list(drives), coalesce=False)
    recs = sorted(c.records.values(), key=lambda x: (x.file, x.offset))[:max(wave, n_bytes // c.record_bytes)]
    arena = np.frombuffer(mmap.mmap(-1, wave * c.record_bytes), np.uint8).reshape(wave, c.record_bytes)
    t0 = time.perf_counter()
    for i in range(0, len(recs), wave):
        for f in [r.submit((x.layer, x.expert), arena[j]) for j, x in enumerate(recs[i:i + wave])]:
            f.result()
    dt = time.perf_counter() - t0
    shares = [d["share"] for d in r.drives.describe()]
    r.close()
    return {"gbs": round(len(recs) * c.record_bytes / dt / 1e9, 3), "records": len(recs), "shares": shares}


def two_drives(a, path: str, budget: int, ids) -> None:
    """One drive against two: throttled loop drives, and two directories of one disk."""
    work = os.path.join(a.workdir, "two-drives")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    rows, bps = [], int(a.drive_mbs * 1e6)
    same_disk = os.path.join(work, "same-disk-copy")
    stage(open_container(path), same_disk)
    raw = {"one drive (the disk)": reader_gbs(path, io_threads=a.io_threads),
           "two directories on the same disk": reader_gbs(path, (same_disk,), a.io_threads)}
    rows.append(one(path, budget, ids, a, "one drive (the disk)"))
    rows.append(one(path, budget, ids, a, "two directories on the same disk", drives=(same_disk,)))
    try:
        with contextlib.ExitStack() as stack:
            m0, dev0, _ = stack.enter_context(loop_file_system(work, "d0", int(size * 1.2) + (256 << 20)))
            m1, dev1, _ = stack.enter_context(loop_file_system(work, "d1", int(size * 1.2) + (256 << 20)))
            there = os.path.join(m0, "model")
            shutil.copytree(path, there)
            stage(open_container(there), os.path.join(m1, "copy"))
            with throttled({dev0: bps, dev1: bps}):
                raw[f"one loop drive at {a.drive_mbs:.0f} MB/s"] = reader_gbs(there, io_threads=a.io_threads)
                raw[f"two loop drives at {a.drive_mbs:.0f} MB/s each"] = reader_gbs(
                    there, (os.path.join(m1, "copy"),), a.io_threads)
                rows.append(one(there, budget, ids, a, f"one loop drive at {a.drive_mbs:.0f} MB/s"))
                rows.append(one(there, budget, ids, a, f"two loop drives at {a.drive_mbs:.0f} MB/s each",
                                drives=(os.path.join(m1, "copy"),)))
    except Unavailable as e:
        rows.append({"config": "throttled loop drives", "skipped": str(e)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        r.pop("bytes_read", None)
        print(json.dumps(r), file=sys.stderr)
    by = {r["config"]: r for r in rows}

    def ratio(two: str, one_: str, of=lambda name: by.get(name, {}).get("read_gbs")):
        t, o = of(two), of(one_)
        return round(t / o, 3) if t and o else None

    def drives_ratio(two: str, one_: str):
        return ratio(two, one_, lambda name: raw.get(name, {}).get("gbs"))

    print(provenance.dumps({"benchmark": "drives-two", "container": path, "budget_fraction": a.budget,
                      "budget_bytes": budget, "tokens": a.tokens, "prompt_tokens": a.prompt_tokens,
                      "io_threads": a.io_threads, "drive_mbs": a.drive_mbs,
                      "reader_gbs": raw,
                      "two_over_one_drive_gbs": {
                          "throttled loop drives": drives_ratio(f"two loop drives at {a.drive_mbs:.0f} MB/s each",
                                                                f"one loop drive at {a.drive_mbs:.0f} MB/s"),
                          "same disk": drives_ratio("two directories on the same disk", "one drive (the disk)")},
                      "two_over_one_decode_read_gbs": {
                          "throttled loop drives": ratio(f"two loop drives at {a.drive_mbs:.0f} MB/s each",
                                                         f"one loop drive at {a.drive_mbs:.0f} MB/s"),
                          "same disk": ratio("two directories on the same disk", "one drive (the disk)")},
                      "results": rows}, indent=2))


if __name__ == "__main__":
    main()
