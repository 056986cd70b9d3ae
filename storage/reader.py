"""The expert reader: one record from a container's expert files into a buffer.

O_DIRECT `preadv` (whole 4 KiB-aligned records into page-aligned slots) from a small
thread pool, buffered reads where the file system refuses O_DIRECT. Records adjacent in
their file and needed together are read as one request (`submit_run`: one `preadv` whose
iovecs are the records' slots, up to MAX_RUN_BYTES), so the drive sees one large read
instead of several; a record of such a run that fails is read again alone. With copies of
the expert files on other drives (drives.py), each record is read from the drive its
stripe unit hashes to, weighted by the drives' bandwidth measured at start, on that
drive's own threads. Each read checked against the manifest's crc32 (as `verify` says,
per drive: each copy is checked on its own); a failed or corrupted read is tried once more,
then on each other drive holding a copy, then it raises ExpertReadError naming the layer,
expert, file and offset. COLIBRI_FAULTS drills (faults.py) make chosen reads fail.
"""

import logging
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .container import Container, ExpertRecord, crc32
from .drives import START_S, Drive, DriveSet
from .errors import ExpertReadError
from .experts import ExpertStats
from .faults import FaultPlan, inject

log = logging.getLogger("colibri.storage")
MAX_RUN_BYTES = 8 << 20  # the largest run of adjacent records read as one request
READERS = ("preadv", "io_uring", "auto")  # auto: io_uring where it works and reads faster, measured at start
AUTO_PROBE_RECORDS = 32
TABLE_LAYER = -1  # the drive hash's layer for a streamed table's pages (tables.py)
VERIFY_MODES = ("first", "always", "off")  # checksum each expert's first read per start, every read, or none


def pace_steps(n: int) -> int:
    """n steps of pure-Python work (holding the interpreter as the engine thread's glue does)."""
    x = 0
    for i in range(n):
        x += i & 7
    return n


def tries(failed: list[str]) -> str:
    """The reasons reads failed, each said once (with how many tries it was)."""
    said = [(w, failed.count(w)) for i, w in enumerate(failed) if w not in failed[:i]]
    return "; ".join(w + (f" ({n} tries)" if n > 1 else "") for w, n in said)


class ExpertReader:
    """Reads `container`'s expert records on `io_threads` threads, counting into `stats`
    (bytes are counted by the cache, which knows which reads it used).

    Raises ValueError for an unknown verify mode, OSError when an expert file cannot be
    opened (a copy on another drive that cannot be used is logged and left out). `drives`:
    directories on other drives with copies of the expert files (drives.py)."""

    def __init__(self, container: Container, stats: ExpertStats, io_threads: int = 2, direct: bool = True,
                 verify: str = "first", drives: list[str] | None = None, faults: FaultPlan | None = None,
                 coalesce: bool = True, reader: str = "preadv", queue_depth: int = 32, sqpoll_cpu: int | None = None):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}")
        self.c, self.stats = container, stats
        # records per request at most (1: every record alone); a fault drill reads one at a time,
        # so that its chosen reads are the ones that fail
        self.max_run = max(1, MAX_RUN_BYTES // container.record_bytes) if coalesce and not faults else 1
        self.io_threads, self.verify, self.faults = io_threads, verify, faults
        self._io_lock = threading.Lock()  # guards the two below (engine and I/O threads)
        self._io_busy, self._io_since = 0, 0.0  # reads submitted and not finished; since when some are
        self.direct, self.fallback_reason = direct, None
        self.drives = DriveSet(container, list(drives or []), self._open, io_threads)
        self.fds = self.drives.drives[0].fds  # the container's own files
        # the pool that checks what the ring read (and the container's drive's own readers)
        self.pool: ThreadPoolExecutor = self.drives.drives[0].pool
        self.verified: set[tuple[int, int, int]] = set()  # (drive, layer, expert) whose copy matched this start
        self.bad: dict[tuple[int, int], str] = {}  # experts whose last read failed, and why
        self.uring, self.kind, self.kind_why = None, "preadv", None
        if reader not in READERS:
            raise ValueError(f"reader must be one of {READERS}")
        if len(self.drives.drives) > 1:
            self.drives.set_weights([self.measure(0, d, START_S)[0] for d in self.drives.drives])
        if reader != "preadv" and container.extents:
            self.kind_why = "a GGUF file's experts are three reads each, read by the preadv pool"
        elif reader != "preadv":
            self._start_uring(reader, queue_depth, sqpoll_cpu)

    def _open(self, file: str) -> int:
        if self.direct:
            try:
                return os.open(file, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                self.direct = False
                self.fallback_reason = f"O_DIRECT refused on {file} ({e.strerror}); using buffered reads"
                log.warning(self.fallback_reason)
        return os.open(file, os.O_RDONLY)

    def _start_uring(self, asked: str, depth: int, sqpoll_cpu: int | None) -> None:
        """io_uring where it works (storage/uring.py); with "auto", only when it reads faster
        than the pool here (measured now, on the container's own records). Says why not."""
        from .uring import Uring, usable

        why = usable()
        if why is None:
            try:
                self.uring = Uring(depth, sqpoll_cpu)
            except OSError as e:
                why = f"io_uring could not be set up: {e.strerror or e}"
        if why is not None:
            self.kind_why = why
            (log.warning if asked == "io_uring" else log.info)("reader %s: %s; reading with the preadv pool", asked,
                                                                why)
            return
        self.kind = "io_uring"
        if asked == "auto":
            ring_gbs, ring_work = self.measure(0)
            self.uring, ring = None, self.uring
            pool_gbs, pool_work = self.measure(AUTO_PROBE_RECORDS)  # other records: none comes from a cache
            # faster for the engine: more bytes a second, and the engine's own thread not slowed
            # (the binding holds the GIL in some calls; on a small box that can cost more than it saves)
            self.auto_measured = {"io_uring": (ring_gbs, ring_work), "preadv": (pool_gbs, pool_work)}
            if ring_gbs > pool_gbs and ring_work >= 0.9 * pool_work:
                self.uring = ring
            else:
                ring.close()
                self.kind = "preadv"
            self.kind_why = (f"auto: io_uring read {ring_gbs:.2f} GB/s leaving the engine thread {ring_work:.0%} of "
                             f"its pace, the preadv pool {pool_gbs:.2f} GB/s and {pool_work:.0%}, on "
                             f"{AUTO_PROBE_RECORDS} records each")
            log.info("reader %s", self.kind_why)

    def measure(self, first: int, drive: Drive | None = None, min_s: float = 0.0) -> tuple[float, float]:
        """(GB/s, the calling thread's pace) of reading AUTO_PROBE_RECORDS of the
        container's records from the `first` on (in file order; those `drive` holds, by
        default the container's own) all in flight at once, through the ring when there is
        one, else the drive's pool, again until `min_s` have passed: raw reads into a scratch buffer
        (no checks, retries or drills, and a failed read only counts as no bytes: measuring
        never fails a start). The pace: Python steps the calling thread makes meanwhile,
        as a fraction of its pace alone (the engine thread's share of the interpreter)."""
        drive = drive or self.drives.drives[0]
        fds = drive.fds
        recs = sorted((r for r in self.c.records.values() if r.file in fds), key=lambda r: (r.file, r.offset))
        recs = recs[first:first + AUTO_PROBE_RECORDS] or recs[:AUTO_PROBE_RECORDS]
        rb = self.c.record_bytes
        scratch = np.frombuffer(mmap.mmap(-1, rb * len(recs)), np.uint8)
        bufs = [scratch[i * rb:(i + 1) * rb] for i in range(len(recs))]
        t0 = time.perf_counter()
        steps = got = 0
        while True:
            if self.uring is not None:
                futures = [self.uring.read(fds[r.file], [b], r.offset) for r, b in zip(recs, bufs)]
            else:
                futures = [drive.pool.submit(os.preadv, fds[r.file], [b], r.offset) for r, b in zip(recs, bufs)]
            while not all(f.done() for f in futures):
                steps += pace_steps(1000)
            got += sum(f.result() for f in futures if f.exception() is None)
            elapsed = time.perf_counter() - t0
            if elapsed >= min_s:
                break
        t1 = time.perf_counter()
        alone = pace_steps(100_000) / (time.perf_counter() - t1)
        return got / elapsed / 1e9, min(1.0, steps / elapsed / alone) if steps else 1.0

    def close(self) -> None:
        if self.uring is not None:
            self.uring.close()
        self.drives.close()

    def submit(self, key: tuple[int, int], buf: np.ndarray) -> Future:
        """Start reading expert `key` into `buf` on the I/O threads. `io_wall_s` counts the
        time during which at least one submitted read has not finished, prefetches included.
        The future raises ExpertReadError."""
        rec = self.c.records[key]
        if self.uring is not None and not rec.extents:  # (a record of several extents: the pool's reads)
            return self.submit_run([(key, buf)])[0]
        self._busy(+1)
        drive = self.drives.pick(rec, rec.length)
        return drive.pool.submit(self._read_counted, rec, buf, drive)

    def adjacent(self, a: tuple[int, int], b: tuple[int, int]) -> bool:
        """Whether expert b's record follows expert a's in the same file, on the same drive."""
        ra, rb = self.c.records[a], self.c.records[b]
        return (not ra.extents and not rb.extents and ra.file == rb.file and rb.offset == ra.offset + ra.length
                and self.drives.first(ra) is self.drives.first(rb))

    def submit_run(self, reads: list[tuple[tuple[int, int], np.ndarray]]) -> list[Future]:
        """Start reading records that follow each other in one file (adjacent(), in order),
        each into its buffer, as one request; a future per record, as submit() gives."""
        if len(reads) == 1 and (self.uring is None or self.c.records[reads[0][0]].extents):
            return [self.submit(*reads[0])]
        recs, bufs = [self.c.records[k] for k, _ in reads], [b for _, b in reads]
        futures = [Future() for _ in reads]
        self._busy(+1)
        drive = self.drives.pick(recs[0], sum(r.length for r in recs))
        if self.uring is None:
            drive.pool.submit(self._read_run, drive, recs, bufs, futures)
        else:  # in flight on the ring; checked (and retried when bad) on the pool once it lands
            t0 = self._begin(drive)
            ring = self.uring.read(drive.fds[recs[0].file], bufs, recs[0].offset)
            ring.add_done_callback(lambda f: drive.pool.submit(self._ring_landed, drive, recs, bufs, futures, f, t0))
        return futures

    def _busy(self, step: int) -> None:
        with self._io_lock:
            if step > 0 and not self._io_busy:
                self._io_since = time.perf_counter()
            self._io_busy += step
            if step < 0 and not self._io_busy:
                self.stats.io_wall_s += time.perf_counter() - self._io_since

    def _begin(self, drive: Drive) -> float:
        """A request to `drive` starts: counted, and its time (for drives.end)."""
        with self._io_lock:  # (the I/O threads count together)
            self.stats.read_requests += 1
        return self.drives.begin(drive)

    def _read_counted(self, rec: ExpertRecord, buf: np.ndarray, drive: Drive) -> float:
        try:
            return self.read(rec, buf, drive)
        finally:
            self.drives.done(drive, rec.length)
            self._busy(-1)

    def _read_run(self, drive: Drive, recs: list[ExpertRecord], bufs: list[np.ndarray],
                  futures: list[Future]) -> None:
        """One preadv for the run, then _settle."""
        t0 = self._begin(drive)
        try:
            n, why = os.preadv(drive.fds[recs[0].file], [memoryview(b) for b in bufs], recs[0].offset), None
        except OSError as e:
            n, why = 0, e.strerror or str(e)
        self._settle(drive, recs, bufs, futures, n, why, t0)

    def _ring_landed(self, drive: Drive, recs, bufs, futures, ring: Future, t0: float) -> None:
        try:
            n, why = ring.result(), None
        except OSError as e:
            n, why = 0, e.strerror or str(e)
        self._settle(drive, recs, bufs, futures, n, why, t0)

    def _settle(self, drive: Drive, recs: list[ExpertRecord], bufs: list[np.ndarray], futures: list[Future], n: int,
                why: str | None, t0: float) -> None:
        """A request of one or more adjacent records has landed from `drive` with n bytes (or
        failed, and `why`): each record is checked on its own, and one that fails (a short
        read, a checksum, a fault drill) is read again alone (read(): retried, then the other
        drives)."""
        want = sum(r.length for r in recs)
        self.drives.end(drive, t0, n, why if why else None if n >= want else f"short read of a run, {n} bytes")
        self.drives.done(drive, want)
        try:
            got = 0
            for rec, buf, fut in zip(recs, bufs, futures):
                bad = why
                fault = self.faults.take(drive.index, rec.layer, rec.expert) if self.faults and not bad else None
                if fault:  # a drill (faults.py) on the ring's read, as _read_once does on the pool's
                    try:
                        if inject(fault, buf, 0) is not None:
                            bad = "short read (injected)"
                    except OSError as e:
                        bad = e.strerror
                if bad is None:
                    bad = f"short read of a run, {n} bytes" if n < got + rec.length else self._check(rec, buf, drive)
                got += rec.length
                if bad is None:
                    self.bad.pop((rec.layer, rec.expert), None)
                    fut.set_result(time.monotonic() - t0)
                    continue
                self.stats.read_errors += 1
                log.warning("layer %d expert %d: %s in a read of %d record%s; reading it alone", rec.layer,
                            rec.expert, bad, len(recs), "s" if len(recs) > 1 else "")
                try:
                    fut.set_result(self.read(rec, buf))
                except ExpertReadError as e:
                    fut.set_exception(e)
        except BaseException as e:  # a bug must reach the waiting engine, not vanish in the pool
            for fut in futures:
                if not fut.done():
                    fut.set_exception(e)
        finally:
            self._busy(-1)

    def read(self, rec: ExpertRecord, buf: np.ndarray, first: Drive | None = None) -> float:
        """Read one record into `buf` (on the calling thread; from `first` first, by default
        the drive its unit hashes to), verified, retried, then from each other drive holding
        a copy. Raises ExpertReadError: the buffer's bytes are then not to be used. Returns
        the seconds it took."""
        t0 = time.monotonic()
        key = (rec.layer, rec.expert)
        order = self._order(rec, first)
        failed = []
        for d in [order[0], *order]:  # the first choice twice (an error may pass), then each other copy
            why = self._read_once(rec, buf, d)
            if why is None:
                if failed:
                    log.warning("layer %d expert %d: read from drive %d after %s", rec.layer, rec.expert, d.index,
                                "; ".join(failed))
                self.bad.pop(key, None)
                return time.monotonic() - t0
            self.stats.read_errors += 1
            failed.append(f"{self.where(d)} {os.path.join(d.root, os.path.basename(rec.file))}: {why}")
        msg = (f"cannot read layer {rec.layer} expert {rec.expert} from {rec.file} at offset {rec.offset}: "
               + tries(failed))
        self.bad[key] = msg
        log.error("%s", msg)
        raise ExpertReadError(msg)

    @staticmethod
    def where(d: Drive) -> str:
        return "primary" if d.index == 0 else f"drive {d.index}"

    def _read_once(self, rec: ExpertRecord, row: np.ndarray, d: Drive) -> str | None:
        """One attempt on drive d (each of the record's extents in turn); why it failed, or None."""
        fault = self.faults.take(d.index, rec.layer, rec.expert) if self.faults else None
        for x in rec.spans:
            buf, done = memoryview(row)[x.at:x.at + x.length], 0
            while done < x.need:
                t0 = self._begin(d)
                try:
                    n = os.preadv(d.fds[x.file], [buf[done:]], x.offset + done)
                    if fault:  # a drill (faults.py): this read fails as told
                        forced, fault = inject(fault, row[x.at:], done), None
                        n = n if forced is None else forced
                except OSError as e:
                    self.drives.end(d, t0, 0, e.strerror or str(e))
                    return e.strerror or str(e)
                if n <= 0:
                    why = f"short read, {done} of {x.need} bytes" + (f" at {x.file}:{x.offset}" if rec.extents else "")
                    self.drives.end(d, t0, 0, why)
                    return why
                self.drives.end(d, t0, n, None)
                done += n
        why = self._check(rec, row, d)
        if why is not None:
            self.drives.bad_copy(d)
        return why

    def _check(self, rec: ExpertRecord, row: np.ndarray, d: Drive) -> str | None:
        """The record's bytes (read from drive d) against the manifest's crc32, as `verify`
        says; why not, or None."""
        key = (d.index, rec.layer, rec.expert)
        if rec.crc32 is None:  # no checksum to check against (a GGUF file's expert)
            return None
        if self.verify == "always" or (self.verify == "first" and key not in self.verified):
            t = time.perf_counter()
            crc = crc32(row)
            self.stats.verify_s += time.perf_counter() - t
            self.stats.verified += 1
            if crc != rec.crc32:
                return f"checksum mismatch (crc32 {crc:08x}, the manifest says {rec.crc32:08x})"
            self.verified.add(key)
        return None

    # ---- pages of the streamed tables (tables.py) ------------------------------------------

    def _order(self, rec: ExpertRecord, first: Drive | None) -> list[Drive]:
        """The drives to read rec from in turn: `first` first (when it holds a copy), then
        the others in drives.order's."""
        order = self.drives.order(rec)
        return order if first is None or first not in order else [first, *(d for d in order if d is not first)]

    def submit_page(self, file: str, offset: int, length: int, crc: int, what: str) -> Future:
        """Start reading `length` bytes at `offset` of `file` (a streamed table's page of the
        dense file; fewer at the file's end) into an aligned buffer, on the threads of the
        drive its stripe unit hashes to: always checked against `crc`, tried once more, then
        on each other drive holding a copy of the file. The future gives the bytes or raises
        ExpertReadError naming `what`."""
        rec = ExpertRecord(TABLE_LAYER, offset // length, file, offset, length, crc)
        d = self.drives.pick(rec, length)
        return d.pool.submit(self._read_page, rec, what, d)

    def _read_page(self, rec: ExpertRecord, what: str, first: Drive) -> np.ndarray:
        try:
            buf = np.frombuffer(mmap.mmap(-1, rec.length), np.uint8)  # page aligned, as O_DIRECT wants
            order, failed = self._order(rec, first), []
            for d in [order[0], *order]:  # as read(): the first choice twice, then each other copy
                t0 = self.drives.begin(d)
                try:
                    n, why = os.preadv(d.fds[rec.file], [buf], rec.offset), None
                except OSError as e:
                    n, why = 0, e.strerror or str(e)
                why = why or (None if n > 0 else "short read, 0 bytes")
                self.drives.end(d, t0, n, why)
                if why is None:
                    if crc32(buf[:n]) == rec.crc32:
                        return buf[:n]
                    why = "checksum mismatch"
                    self.drives.bad_copy(d)
                failed.append(f"{self.where(d)}: {why}")
            msg = f"{what} cannot be read: {tries(failed)}"
            log.error("%s", msg)
            raise ExpertReadError(msg)
        finally:
            self.drives.done(first, rec.length)  # (pick() counted it as queued there)

    def describe(self) -> dict:
        return {"verify": self.verify if self.c.checksums else "off", "checksums": self.c.checksums, "drives": [d.root for d in self.drives.drives[1:]],
                "bad_experts": [f"{il}:{ie}: {why}" for (il, ie), why in sorted(self.bad.items())],
                "io_threads": self.io_threads, "o_direct": self.direct, "fallback_reason": self.fallback_reason,
                "records_per_read": self.max_run, "reader": self.kind, "reader_note": self.kind_why,
                **({"queue_depth": self.uring.depth, "sqpoll_cpu": self.uring.sqpoll} if self.uring else {})}
