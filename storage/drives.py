"""The drives expert records are read from, and which of them reads each record.

The container's own directory is drive 0; `drives:` (colibri.yaml) names directories on
other drives holding copies of the expert files, all of them or some (`colictl drives
stage` makes them), and of the dense file's streamed table pages (tables.py), which are
read the same way. A copy of a file is used when it has the container's size, safetensors
header and first page of expert bytes; a stale copy of another model, or one still being
staged, is left out with the reason. (Every record read from a copy is still checked
against the manifest on its first read from that drive.)

Which drive reads a record: weighted rendezvous hashing (highest random weight) of the
record's stripe unit, a run of STRIPE_BYTES of its file, over the drives in rotation that
hold the file, each weighted by its bandwidth: measured at start (O_DIRECT reads of its
records for START_S), then, after every LAG_WINDOW_BYTES it reads, moved halfway to the
bandwidth it delivered over that window per second of busy time (a start figure flattered
by a throttle's burst or a cache, or a drive that slows, corrects itself within a few
windows). Each drive gets a share of the units in proportion to its weight; the choice is
the same for the same weights; a weight that changes, or a drive leaving the rotation,
moves only the units at the margin; and the adjacent records of one unit stay on one
drive, so they are still read as one request. The hash names each unit's two preferred
drives; a read goes to the first unless reads are queued there and the second would finish
it sooner, counting the bytes queued on each at its weight (the power of two choices): a step's few
misses hash unevenly, and without it the drive given more of them holds the step back.

A drive leaves the rotation when a read on it fails with an I/O error or comes back short,
when its reads stall (some in flight, none finished for STALL_S), or when it lags (over its
last LAG_WINDOW_BYTES, bytes per second of busy time fell below 1/LAG_FACTOR of its start
figure). It is tried again after RETRY_S, doubling up to RETRY_MAX_S while it keeps
failing. A drive out of rotation is still the last resort: no read fails while a good copy
exists on some drive. A checksum mismatch is a fault of one record's copy, not of the
drive: that record is read elsewhere and the drive stays.
"""

import logging
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .container import Container, ExpertRecord
from .tables import streamed_tables_file

log = logging.getLogger("colibri.storage")
STRIPE_BYTES = 2 << 20  # the unit a drive is chosen for: at least one record
START_S = 0.3  # each drive's bandwidth is measured this long at start
STALL_S = 5.0  # reads in flight on a drive and none finished this long: the drive is out
LAG_FACTOR = 10.0  # slower than its start figure by this much: the drive is out (less: its weight follows)
LAG_WINDOW_BYTES = 64 << 20  # bytes over which a drive's pace is judged (at least LAG_WINDOW_READS reads)
LAG_WINDOW_READS = 8
RETRY_S = 10.0
RETRY_MAX_S = 300.0
LATENCIES = 1024  # requests kept per drive for the latency percentiles


def mix64(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def hrw_score(layer: int, unit: int, drive: int, weight: float) -> float:
    """Weighted rendezvous score: the drive with the highest reads the unit. With u uniform
    in (0, 1), weight / -ln(u) is highest for a drive with probability weight / sum."""
    u = (mix64(mix64(mix64(layer) ^ unit) ^ drive) + 0.5) / 2.0**64
    return weight / -math.log(u)


@dataclass
class Drive:
    index: int
    root: str  # the directory holding its expert files
    fds: dict[str, int]  # container file (absolute path) -> open descriptor of this drive's copy
    pool: ThreadPoolExecutor
    left_out: dict[str, str] = field(default_factory=dict)  # file name -> why this drive's copy is not used
    gbs: float | None = None  # its weight: GB/s measured at start, then as it reads (None: one drive)
    start_gbs: float | None = None  # the start's figure (lag is judged against it)
    bytes: int = 0
    reads: int = 0
    errors: int = 0
    busy_s: float = 0.0  # time with at least one of its reads in flight
    inflight: int = 0
    queued: int = 0  # bytes of requests submitted to it and not finished (for pick())
    since: float = 0.0  # start of the current busy stretch
    last_done: float = 0.0  # when a read last finished, or a busy stretch began
    latencies: deque = field(default_factory=lambda: deque(maxlen=LATENCIES))
    window: list = field(default_factory=lambda: [0, 0, 0.0])  # [bytes, reads, busy_s at the start] of the lag window
    out_until: float | None = None  # out of rotation until then (time.monotonic)
    out_why: str | None = None
    backoff: float = RETRY_S
    outs: int = 0  # times taken out of rotation

    def busy_now(self, now: float) -> float:
        return self.busy_s + (now - self.since if self.inflight else 0.0)


class DriveSet:
    """The container's drive and its copies. Thread-safe: the engine thread orders reads,
    the I/O threads report them. Raises OSError when the container's own expert files
    cannot be opened."""

    def __init__(self, container: Container, copies: list[str], open_fd, io_threads: int):
        self.c = container
        self.stripe = max(1, STRIPE_BYTES // container.record_bytes) * container.record_bytes
        self.lock = threading.Lock()
        first = {}  # file -> offset of its first record: the bytes up to it and a page more must match
        for r in container.records.values():
            for x in r.spans:
                first[x.file] = min(first.get(x.file, x.offset), x.offset)
        heads = {f: at + 4096 for f, at in first.items()}
        table_file = streamed_tables_file(container)
        if table_file:  # (its copy holds the header and the tables' pages: the header must match)
            heads[table_file[0]] = table_file[1]
        files = sorted(heads)
        self.drives: list[Drive] = []
        for i, root in enumerate([container.path, *copies]):
            pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix=f"colibri-io{i}")
            d = Drive(i, root, {}, pool)
            for file in files:
                path = os.path.join(root, os.path.basename(file))
                if i == 0:
                    d.fds[file] = open_fd(path)
                    continue
                why = self._copy_problem(file, path, heads[file])
                if why is None:
                    try:
                        d.fds[file] = open_fd(path)
                    except OSError as e:
                        why = e.strerror or str(e)
                if why is not None:
                    d.left_out[os.path.basename(file)] = why
            if i and d.left_out:
                log.warning("drive %d (%s): %d of %d expert files not used: %s", i, root, len(d.left_out), len(files),
                            "; ".join(f"{n}: {w}" for n, w in sorted(d.left_out.items())[:3]))
            self.drives.append(d)
        self._orders: dict[tuple[int, int, str], list[Drive]] = {}  # order()'s answers, until the rotation changes

    @staticmethod
    def _copy_problem(file: str, copy: str, head: int) -> str | None:
        """Why `copy` cannot stand in for `file` (None: it can): missing, another size, or
        other first `head` bytes (a copy of another model or conversion)."""
        try:
            if os.path.getsize(copy) != os.path.getsize(file):
                return "not the container's size (still being staged, or another model's)"
            with open(file, "rb") as a, open(copy, "rb") as b:
                if a.read(head) != b.read(head):
                    return "its first bytes differ from the container's (a copy of another model)"
        except OSError as e:
            return e.strerror or str(e)
        return None

    def close(self) -> None:
        for d in self.drives:
            d.pool.shutdown(wait=True)
            for fd in d.fds.values():
                os.close(fd)
            d.fds.clear()

    # ---- which drive reads what -------------------------------------------------------------

    def order(self, rec: ExpertRecord) -> list[Drive]:
        """The drives holding rec's file, the one to read it from first: those in rotation by
        their weighted hash of the record's stripe unit, then those out of rotation (the last
        resort), soonest back first."""
        if len(self.drives) == 1:
            return self.drives
        unit = rec.offset // self.stripe
        with self.lock:
            self._watch(time.monotonic())
            key = (rec.layer, unit, rec.file)
            got = self._orders.get(key)
            if got is None:
                holding = [d for d in self.drives if rec.file in d.fds]
                rotation = sorted((d for d in holding if d.out_until is None),
                                  key=lambda d: -hrw_score(rec.layer, unit, d.index, d.gbs or 1.0))
                got = self._orders[key] = rotation + sorted((d for d in holding if d.out_until is not None),
                                                            key=lambda d: d.out_until)
            return got

    def _watch(self, now: float) -> None:
        """Drives due back come back; a drive whose reads stall goes out (under the lock)."""
        for d in self.drives:
            if d.out_until is not None:
                if now >= d.out_until:
                    self._back(d, now)
            elif d.inflight and now - d.last_done > STALL_S:
                self._out(d, f"no read finished in {now - d.last_done:.1f} s with {d.inflight} in flight")

    def first(self, rec: ExpertRecord) -> Drive:
        """The drive rec's unit hashes to first (adjacent records share it)."""
        return self.order(rec)[0]

    def pick(self, rec: ExpertRecord, n_bytes: int) -> Drive:
        """The drive to read n_bytes starting with rec from: of the unit's two preferred
        drives in rotation, the first unless reads are queued on it and the second would
        finish sooner (an idle drive keeps the hash's choice). Counts the bytes as queued there until done(d, n_bytes)."""
        order = self.order(rec)
        two = [d for d in order[:2] if d.out_until is None] or order[:1]
        with self.lock:
            d = two[0]
            if len(two) > 1 and d.queued and (d.queued + n_bytes) / (d.gbs or 1.0) > \
                    (two[1].queued + n_bytes) / (two[1].gbs or 1.0):
                d = two[1]
            d.queued += n_bytes
        return d

    def done(self, d: Drive, n_bytes: int) -> None:
        """A request pick() placed on d has finished (read, failed over, or failed)."""
        with self.lock:
            d.queued -= n_bytes

    # ---- what the reads report --------------------------------------------------------------

    def begin(self, d: Drive) -> float:
        """A read on d starts now (returns the time, for end())."""
        now = time.monotonic()
        with self.lock:
            if not d.inflight:  # a busy stretch starts; so does the stall clock
                d.since = d.last_done = now
            d.inflight += 1
            d.reads += 1
        return now

    def end(self, d: Drive, t0: float, n_bytes: int, why: str | None) -> None:
        """A read on d that began at t0 has finished with n_bytes (or failed, and why)."""
        now = time.monotonic()
        with self.lock:
            d.inflight -= 1
            if not d.inflight:
                d.busy_s += now - d.since
            d.last_done = now
            if why is not None:
                d.errors += 1
                if d.out_until is None and len(self.drives) > 1:
                    self._out(d, why)
                return
            d.bytes += n_bytes
            d.latencies.append(now - t0)
            w = d.window
            w[0] += n_bytes
            w[1] += 1
            if w[0] >= LAG_WINDOW_BYTES and w[1] >= LAG_WINDOW_READS:
                busy = d.busy_now(now) - w[2]
                pace = w[0] / busy / 1e9 if busy > 0 else math.inf
                d.window = [0, 0, d.busy_now(now)]
                if d.start_gbs and pace < d.start_gbs / LAG_FACTOR and d.out_until is None and len(self.drives) > 1:
                    self._out(d, f"lags: {pace:.3f} GB/s over its last {w[1]} reads, {d.start_gbs:.3f} GB/s at "
                                 "start")
                elif d.out_until is None:
                    d.backoff = RETRY_S  # a whole window read well: the next time out is short again
                    if d.gbs and math.isfinite(pace):
                        d.gbs = 0.5 * d.gbs + 0.5 * pace
                        self._orders.clear()

    def bad_copy(self, d: Drive) -> None:
        """A record read from d did not match its checksum: an error of that copy, which is
        read elsewhere; the drive stays in rotation."""
        with self.lock:
            d.errors += 1

    def _out(self, d: Drive, why: str) -> None:
        d.out_until, d.out_why = time.monotonic() + d.backoff, why
        d.outs += 1
        log.warning("drive %d (%s) out of rotation for %.0f s: %s", d.index, d.root, d.backoff, why)
        d.backoff = min(RETRY_MAX_S, 2 * d.backoff)
        self._orders.clear()

    def _back(self, d: Drive, now: float) -> None:
        log.info("drive %d (%s) back in rotation after: %s", d.index, d.root, d.out_why)
        d.out_until, d.out_why = None, None
        d.window = [0, 0, d.busy_now(now)]
        self._orders.clear()

    def set_weights(self, gbs: list[float]) -> None:
        with self.lock:
            for d, g in zip(self.drives, gbs):
                d.gbs = d.start_gbs = g
            self._orders.clear()

    # ---- what it says -----------------------------------------------------------------------

    def describe(self) -> list[dict]:
        """Per drive: where, how much of the model it holds, its weight and share, what it read
        and how fast, and whether it is in rotation (and if not, why and until when)."""
        now = time.monotonic()
        total = sum(d.bytes for d in self.drives) or 1
        n_files = len(self.drives[0].fds) if self.drives else 0
        out = []
        with self.lock:
            for d in self.drives:
                lat = sorted(d.latencies)
                busy = d.busy_now(now)
                out.append({
                    "drive": d.index, "path": d.root, "files": len(d.fds), "of_files": n_files,
                    "left_out": dict(sorted(d.left_out.items())), "measured_gbs": round(d.gbs, 3) if d.gbs else None,
                    "start_gbs": round(d.start_gbs, 3) if d.start_gbs else None,
                    "bytes": d.bytes, "reads": d.reads, "errors": d.errors, "share": round(d.bytes / total, 4),
                    "busy_s": round(busy, 3), "gbs": round(d.bytes / busy / 1e9, 3) if busy > 0 else None,
                    "latency_ms_p50": round(1e3 * lat[len(lat) // 2], 3) if lat else None,
                    "latency_ms_p99": round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
                    "in_rotation": d.out_until is None, "times_out": d.outs,
                    **({"out_why": d.out_why, "back_in_s": round(max(0.0, d.out_until - now), 1)}
                       if d.out_until is not None else {}),
                })
        return out
