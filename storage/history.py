"""Usage history: how often each routed expert was needed, decayed, kept across restarts.

A count per (MoE layer, expert): each forward step adds one to every expert a layer
needed in it (the union over the step's tokens, which is what costs a read), and every
count halves over `half_life` steps, so the history follows a box's workload as it
drifts. It picks the pinned hot set at start and repins live (policy.py).

It lives with the daemon's state, not in the container (the model directory may be
read-only): STATE_DIR/history/<container fingerprint>.json, so two models never mix and
a re-converted container starts afresh. The file is written atomically
(statefile.write_atomic): a crash mid-write leaves the previous version. A file of
another format version, another model or bad contents is moved aside with a warning.

With `learned-opt` (policy.py) it also learns, per expert, whether Belady's optimum would
have kept it (optgen.py), and keeps those scores with the counts.

File (JSON): {"format": "colibri-usage-history", "version": 1, "fingerprint": str,
"moe_layers": [int], "n_expert": int, "half_life": steps, "steps": int, "created": unix
time, "saved": unix time, "counts": [[float] * n_expert] * n_moe_layers, and once
`learned-opt` has run: "keep_scores": [[int 0..7] * n_expert] * n_moe_layers}
"""

import json
import os
import time

import numpy as np

from .optgen import SCORE_MAX, OptGen
from .statefile import read_json_state, write_atomic

FORMAT = "colibri-usage-history"
VERSION = 1
DEFAULT_HALF_LIFE = 4096  # forward steps


def history_path(state_dir: str, fingerprint: str) -> str:
    return os.path.join(state_dir, "history", fingerprint.replace(":", "-")[:80] + ".json")


class UsageHistory:
    """Decayed routing counts of the experts of `moe_layers`. `path` None: kept in memory
    only; `read_only`: loaded but never written (for benchmarks)."""

    def __init__(self, moe_layers: list[int], n_expert: int, fingerprint: str = "", path: str | None = None,
                 half_life: float = DEFAULT_HALF_LIFE, read_only: bool = False):
        self.moe_layers, self.n_expert, self.fingerprint = list(moe_layers), n_expert, fingerprint
        self.row = {il: i for i, il in enumerate(self.moe_layers)}
        self.path, self.read_only, self.half_life = path, read_only, float(half_life)
        self.counts = np.zeros((len(self.moe_layers), n_expert))  # [L, E], in units of self.weight
        self.weight = 1.0  # what one use adds now: grows by `growth` per step (lazy decay)
        self.growth = 2.0 ** (1.0 / self.half_life)
        self.steps, self.created, self.saved, self.loaded_steps = 0, time.time(), None, 0
        self.keep_scores: np.ndarray | None = None  # [L, E] int8: what the optimum taught (optgen.py)
        self.learner: OptGen | None = None  # training keep_scores while `learned-opt` runs
        if path:
            self.load()

    # ---- learning ----
    def step(self) -> None:
        """One forward step has begun: older uses weigh a little less."""
        self.steps += 1
        self.weight *= self.growth
        if self.weight > 1e100:
            self.counts /= self.weight
            self.weight = 1.0

    def record(self, il: int, ids) -> None:
        """Layer il needed experts `ids` (unique) in this step."""
        row, w = self.counts[self.row[il]], self.weight
        for ie in ids:  # (a handful: item by item is faster than numpy's fancy indexing)
            row[ie] += w
        if self.learner is not None:
            self.learner.visit(self.row[il], ids)

    def learn_optimum(self, capacity: int | None, top_k: int) -> None:
        """Learn from Belady's optimum for a cache of `capacity` slots from now on (again
        with the new capacity when it changes); None: stop (what was learned stays)."""
        if capacity is None:
            self.learner = None
        elif self.learner is None:
            self.learner = OptGen(*self.counts.shape, capacity, top_k, self.keep_scores)
            self.keep_scores = self.learner.scores  # the same array: trained in place, saved from here
        elif self.learner.capacity != capacity:
            self.learner.resize(capacity, top_k)

    def worth(self, key: tuple[int, int]) -> float:
        """What keeping key = (layer, expert) in the main region is worth: its decayed count;
        while learning from the optimum, that count times 1 + its score (optgen.py), so an
        expert the optimum keeps outweighs one used as often that it lets go."""
        v = self.value(key)
        return v if self.learner is None else v * (1 + int(self.keep_scores[self.row[key[0]], key[1]]))

    def worths(self, rows: np.ndarray, ies: np.ndarray) -> np.ndarray:
        """Numbers in the order of worth() of many: rows (history rows) and ies, alike in shape."""
        c = self.counts[rows, ies]
        return c if self.learner is None else c * (1 + self.keep_scores[rows, ies].astype(np.float64))

    def values(self) -> np.ndarray:
        # -> [L, E] decayed counts: uses, each weighted 2^(-age / half_life)
        return self.counts / self.weight

    def value(self, key: tuple[int, int]) -> float:
        """The decayed count of key = (layer, expert)."""
        return float(self.counts[self.row[key[0]], key[1]] / self.weight)

    def hottest(self, n: int) -> list[tuple[int, int]]:
        """The n experts with the highest counts (used at least once), hottest first."""
        v = self.values().reshape(-1)
        n = min(n, int(np.count_nonzero(v)))
        if n <= 0:
            return []
        top = np.argpartition(-v, n - 1)[:n] if n < v.size else np.arange(v.size)
        top = top[np.argsort(-v[top], kind="stable")]
        return [(self.moe_layers[i // self.n_expert], int(i % self.n_expert)) for i in top]

    # ---- persistence ----
    def _why_unusable(self, obj: dict) -> str | None:
        if obj.get("format") != FORMAT:
            return "not a usage history"
        if obj.get("version") != VERSION:
            return f"usage history version {obj.get('version')!r}, this colibri reads version {VERSION}"
        if obj.get("fingerprint") != self.fingerprint or obj.get("moe_layers") != self.moe_layers \
                or obj.get("n_expert") != self.n_expert:
            return "the usage history of another model"
        c = obj.get("counts")
        try:
            a = np.asarray(c, dtype=np.float64)
        except (TypeError, ValueError):
            return "counts are not numbers"
        if a.shape != self.counts.shape or not np.all(np.isfinite(a)) or np.any(a < 0):
            return f"counts of shape {a.shape} or with negative or non-finite values"
        if not all(isinstance(obj.get(k), int | float) for k in ("steps", "created")):
            return "steps or created missing"
        if "keep_scores" in obj:
            try:
                k = np.asarray(obj["keep_scores"], dtype=np.float64)
            except (TypeError, ValueError):
                return "keep_scores are not numbers"
            if k.shape != self.counts.shape or not np.all((k >= 0) & (k <= SCORE_MAX) & (k == np.round(k))):
                return f"keep_scores of shape {k.shape} or outside 0..{SCORE_MAX}"
        return None

    def load(self) -> bool:
        """Read the file at self.path; True when a usable history was loaded. A damaged
        file is moved aside (with a warning) and the history starts empty."""
        obj = read_json_state(self.path, self._why_unusable)
        if obj is None:
            return False
        self.counts = np.asarray(obj["counts"], dtype=np.float64)
        if "keep_scores" in obj:
            self.keep_scores = np.asarray(obj["keep_scores"], dtype=np.int8)
        self.weight = 1.0
        self.steps = self.loaded_steps = int(obj["steps"])
        self.created, self.saved = float(obj["created"]), obj.get("saved")
        return True

    def to_json(self) -> bytes:
        return json.dumps({
            "format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint, "moe_layers": self.moe_layers,
            "n_expert": self.n_expert, "half_life": self.half_life, "steps": self.steps, "created": self.created,
            "saved": time.time(), "counts": [[float(f"{x:.6g}") for x in row] for row in self.values()],
            **({} if self.keep_scores is None else {"keep_scores": self.keep_scores.tolist()}),
        }).encode()

    def save(self) -> bool:
        """Write the history atomically; False (and nothing written) without a path or when
        read-only. Raises OSError."""
        data = self.snapshot()
        if data is not None:
            self.write(data)
        return data is not None

    def snapshot(self) -> bytes | None:
        """The history as save() writes it, or None without a path or when read-only (the
        encoding is the consistent copy: write() may then run on another thread)."""
        return None if not self.path or self.read_only else self.to_json()

    def write(self, data: bytes) -> None:
        """Write a snapshot() atomically. Raises OSError."""
        write_atomic(self.path, data)
        self.saved = time.time()

    def describe(self) -> dict:
        size = None
        if self.path:
            try:
                size = os.path.getsize(self.path)
            except OSError:
                pass
        return {"path": self.path, "read_only": self.read_only, "half_life_steps": self.half_life,
                "steps": self.steps, "steps_loaded": self.loaded_steps, "age_s": round(time.time() - self.created, 1),
                "saved_age_s": round(time.time() - self.saved, 1) if self.saved else None,
                "experts_seen": int(np.count_nonzero(self.counts)), "file_bytes": size,
                "optimum": self.learner.describe() if self.learner else None}
