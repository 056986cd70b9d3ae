"""io_uring reads for the expert reader: many reads in flight on one ring, submitted and
reaped by one thread, instead of one blocking preadv per pool thread.

The binding is the `liburing` package (Cython over the C liburing). It is optional: where
it is not installed, or where its compiled code does not run on this CPU (a wheel built
for another instruction set dies of SIGILL, which no exception can catch), reads go
through the preadv pool. `usable()` finds out in a child process, so the daemon never
dies of it.

A ring is not thread-safe: the ring thread owns it. Readers hand it (fd, buffers,
offset) through a queue and get a Future of the bytes read (or an OSError). Up to `depth`
reads are in flight; with `sqpoll_cpu`, a kernel thread pinned to that CPU polls the
submission queue (IORING_SETUP_SQPOLL, where the kernel permits it).
"""

import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

PROBE = ("import liburing as L\n"
         "r = L.io_uring()\n"
         "L.io_uring_queue_init(4, r, 0)\n"
         "L.io_uring_queue_exit(r)\n")


SETUP_SQPOLL = 1 << 1  # IORING_SETUP_SQPOLL (the binding's params object cannot set the thread's CPU:
# the kernel thread is pinned afterwards, like any thread of the process)


def pin_sq_thread(cpu: int) -> int | None:
    """Pin this process's submission-queue polling thread (iou-sqp-PID) to `cpu`; the CPU,
    or None when it cannot be found or pinned (it then runs where the scheduler puts it).
    The kernel starts the thread just after the ring is set up: it is looked for a while."""
    for _ in range(50):
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().startswith("iou-sqp"):
                        os.sched_setaffinity(int(tid), {cpu})
                        return cpu
            except OSError:
                continue
        time.sleep(0.004)
    return None


def usable() -> str | None:
    """None when io_uring reads work here, else why not (one line)."""
    try:
        import liburing  # noqa: F401
    except ImportError:
        return "the liburing package is not installed (pip install 'colibri[uring]')"
    try:
        r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot probe io_uring ({e})"
    if r.returncode < 0:
        return f"the liburing binding dies on this CPU (signal {-r.returncode}): reinstall it from source"
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"io_uring does not start here: {last}"
    return None


class Uring:
    """A ring of `depth` entries and the thread that owns it. Raises OSError when the
    ring cannot be set up."""

    def __init__(self, depth: int = 32, sqpoll_cpu: int | None = None):
        import liburing as L

        self.L, self.depth = L, depth
        self.ring = L.io_uring()
        # sqpoll: the CPU the polling thread is pinned to, "unpinned", or None (no polling
        # thread: asked for none, or refused, and sqpoll_refused says why)
        self.sqpoll, self.sqpoll_refused = None, None
        polling = False
        if sqpoll_cpu is not None:
            try:
                L.io_uring_queue_init(depth, self.ring, SETUP_SQPOLL)
                polling = True
                self.sqpoll = pin_sq_thread(sqpoll_cpu)
                if self.sqpoll is None:
                    self.sqpoll = "unpinned"
            except OSError as e:  # not permitted (older kernels: root only) or not supported
                self.sqpoll_refused = e.strerror or str(e)
        if not polling:
            L.io_uring_queue_init(depth, self.ring, 0)
        # The binding's io_uring_wait_cqe blocks holding the GIL (measured: the engine thread
        # ran at 6 % of its speed meanwhile), so the ring thread never waits in it: the kernel
        # signals completions on an eventfd, readers signal new work on the same one, and the
        # thread blocks in os.eventfd_read, which lets the GIL go.
        self.wake = os.eventfd(0, os.EFD_CLOEXEC)
        L.io_uring_register_eventfd(self.ring, self.wake)
        self.inbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="colibri-uring", daemon=True)
        self.thread.start()

    def read(self, fd: int, bufs: list, offset: int) -> Future:
        """Read into `bufs` (writable buffers, in order) from `fd` at `offset`; the Future
        gives the bytes read, or raises OSError."""
        fut: Future = Future()
        self.inbox.put((fd, bufs, offset, fut))
        os.eventfd_write(self.wake, 1)
        return fut

    def close(self) -> None:
        self.inbox.put(None)
        os.eventfd_write(self.wake, 1)
        self.thread.join()
        self.L.io_uring_queue_exit(self.ring)
        os.close(self.wake)

    def _run(self) -> None:
        L, ring = self.L, self.ring
        cqe = L.io_uring_cqe()
        flight: dict[int, tuple] = {}  # user data -> (future, iovec kept alive until the read lands)
        serial, stopping = 0, False
        while not stopping or flight:
            took = 0
            while len(flight) < self.depth and not stopping:  # what waits, as far as the ring has room
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                fd, bufs, offset, fut = item
                sqe = L.io_uring_get_sqe(ring)
                iov = L.iovec([memoryview(b) for b in bufs])
                L.io_uring_prep_readv(sqe, fd, iov, offset)
                serial += 1
                L.io_uring_sqe_set_data64(sqe, serial)
                flight[serial] = (fut, iov)
                took += 1
            if took:
                L.io_uring_submit(ring)
            reaped = 0
            while flight and L.io_uring_peek_cqe(ring, cqe) == 0:  # (-EAGAIN: none now; the cqe is not to be read)
                key, res = L.io_uring_cqe_get_data64(cqe), cqe.res
                L.io_uring_cqe_seen(ring, cqe)
                fut, _ = flight.pop(key)
                if res < 0:
                    fut.set_exception(OSError(-res, os.strerror(-res)))
                else:
                    fut.set_result(res)
                reaped += 1
            if not took and not reaped and (flight or not stopping):
                os.eventfd_read(self.wake)  # a completion or new work (the counter keeps what came meanwhile)
