"""numba options for every kernel module, and where their compiled code is cached.

numba keys a cached kernel on its own file's timestamp only, never on the kernels and
intrinsics it inlines from other files; the kernels live in several files (ir.py,
ir_rows.py, atomics.py, kernels.py, jobs.py, crew.py, a module per number format in formats/ and
its integer dot products), so their cache sits in a directory named after a hash
of all of them: an edit of any one recompiles every kernel that may have inlined it.
NUMBA_CACHE_DIR, when set, is used as is.
"""

import hashlib
import os

import numba

JIT = dict(cache=True, nogil=True)
# reassociating the dot-product sum lets LLVM vectorise it; results differ from a
# sequential sum only in rounding (~1e-7 relative), as any BLAS does
JIT_FAST = dict(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
KERNEL_FILES = ("jit.py", "ir.py", "ir_rows.py", "atomics.py", "kernels.py", "jobs.py", "crew.py", "formats/__init__.py",
                "formats/int8.py", "formats/int4.py", "formats/fp8.py", "formats/mxfp4.py", "formats/intdot.py",
                "formats/ggml.py", "formats/ggml_ir.py")


def _cache_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for name in KERNEL_FILES:
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    name = f"numba-{h.hexdigest()[:16]}"
    local = os.path.join(here, "__pycache__")
    if os.access(local if os.path.isdir(local) else here, os.W_OK):
        return os.path.join(local, name)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "colibri", name)


FAMILY_WARMS: dict = {}  # group name -> fn(): kernels of a family's own, on tiny arrays (family_warm)


def family_warm(name: str):
    """Register fn as the warm-up of kernels a family computes with beside the shared
    paths (engine/warm.py): engine/layers.init runs it for a model whose KERNEL_GROUPS
    names it, before the model's first step."""

    def register(fn):
        FAMILY_WARMS[name] = fn
        return fn

    return register


if not os.environ.get("NUMBA_CACHE_DIR"):
    numba.config.CACHE_DIR = _cache_dir()  # read when a kernel is decorated: before any kernel module's body


class Ticker:
    """Compile progress for `progress(phase, done, total)`, in seconds: done the time spent,
    total the time it is expected to take, at each kernel group and every TICK_S seconds
    within one (the attention group alone takes a minute on 2 cores). The time left is what
    the groups' shares (their seconds on a first compile here) say of the rest, scaled by how
    fast the groups so far went and, while
    a group runs past its share, by how far past; the estimate said moves toward it a part
    at a time as the clock runs down, so it never jumps. Call enter(i) at group i, stop()."""

    TICK_S = 5.0
    EASE = 0.3  # the part of the way from the estimate said to the model's that one report goes

    def __init__(self, progress, shares: list[float]):
        import threading
        import time

        self.progress, self.shares = progress, shares  # each group's seconds on a first compile
        self.t0 = self.t_group = time.perf_counter()
        self.i, self.speed, self.left, self.said = 0, 1.0, None, -1.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._tick, name="colibri-compile-progress", daemon=True)
        self.thread.start()

    def expected_s(self, shares: float) -> float:
        return shares * self.speed

    def enter(self, i: int) -> None:
        import time

        now = time.perf_counter()
        took = now - self.t0
        if i:
            import logging

            logging.getLogger("colibri.engine").debug("compile group %d took %.1f s", i - 1, now - self.t_group)
        if i and took > 1.0:  # how fast the groups so far went against their expected time
            self.speed = min(max(took / self.expected_s(sum(self.shares[:i])) * self.speed, 0.02), 5.0)
        self.i, self.t_group = i, now
        if now - self.said >= 1.0:  # (the small groups pass by the dozen: a line a second at most)
            self.report()

    def model_left(self, now: float) -> float:
        """The time left as the shares say it, now."""
        group = self.expected_s(self.shares[self.i])
        in_group = now - self.t_group
        over = min(max(1.0, in_group / group), 2.0) if group else 1.0  # past its share: the rest is likely slower
        here = group - in_group if over == 1.0 else 0.1 * in_group
        return max(here, 0.0) + self.expected_s(sum(self.shares[self.i + 1:])) * over

    def report(self) -> None:
        import time

        now = time.perf_counter()
        model = self.model_left(now)
        if self.left is None:
            self.left = model
        else:
            self.left = max(self.left - (now - self.said), 0.0)
            self.left += self.EASE * (model - self.left)
        self.said = now
        took = now - self.t0
        try:
            self.progress("compiling kernels", round(took), max(round(took + self.left), round(took) + 1))
        except Exception:  # (the daemon's progress raises once it is told to stop: the load stops after the group)
            pass

    def _tick(self) -> None:
        while not self.done.wait(self.TICK_S):
            self.report()

    def stop(self) -> None:
        self.done.set()


_WATCH = None


class CompileWatch:
    """numba's compile events after start-up (engine/layers.init): each kernel compiled at
    first use is said on stderr (the log) with its time, and `seconds()` adds them up, so
    a speed reported over a step that compiled can leave it out."""

    def __init__(self):
        import logging
        import threading

        from numba.core import event

        self.log = logging.getLogger("colibri.engine")
        self.total_s, self.depth, self.on = 0.0, threading.local(), True

        class Listener(event.Listener):
            def on_start(inner, ev):
                self._start(ev)

            def on_end(inner, ev):
                self._end(ev)

        event.register("numba:compile", Listener())

    def _start(self, ev) -> None:
        import time

        d = getattr(self.depth, "n", 0)
        self.depth.n = d + 1
        if d == 0:
            self.depth.t0 = time.perf_counter()

    def _end(self, ev) -> None:
        import time

        self.depth.n -= 1
        if self.depth.n or not self.on:
            return  # (a kernel compiled inside another's compile: counted in the outer one; init's own)
        took = time.perf_counter() - self.depth.t0
        self.total_s += took
        f = ev.data["dispatcher"].py_func
        self.log.warning("compiled %s.%s at first use in %.2f s (not before start: a kernel the warm-up does not "
                         "reach; the speed reported leaves the time out)", f.__module__.rsplit(".", 1)[-1],
                         f.__qualname__.replace(".<locals>", ""), took)


def watch_compiles(on: bool = True) -> None:
    """From now on, compiles are watched (CompileWatch): call once start-up compiled; with
    `on` false, while it compiles again (init with other kinds)."""
    global _WATCH
    if _WATCH is None and on:
        _WATCH = CompileWatch()
    if _WATCH is not None:
        _WATCH.on = on


def compile_seconds() -> float:
    """Seconds spent compiling kernels at first use since watch_compiles (0 before)."""
    return _WATCH.total_s if _WATCH is not None else 0.0
