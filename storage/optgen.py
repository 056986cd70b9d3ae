"""Belady's optimum replayed online, and what each expert learns from it (`learned-opt`).

After Hawkeye's OPTgen (Jain and Lin, ISCA 2016): over a sliding window of the recent
past, for every reuse of an expert, would the optimal cache of the same number of slots
still have held it since its previous use? The optimal (bypassing) cache keeps an expert
from one use to the next exactly when, at every moment in between, fewer than `capacity`
other kept intervals overlap; an occupancy count per moment of the window answers that
in one slice. Time here is a layer visit: each `visit(row, ids)` (a MoE layer routing a
step's experts) is one moment, and its experts are used at it.

Each (layer, expert) keeps a saturating score (0 .. SCORE_MAX): up when the optimum kept
it from its previous use to this one, down when it did not, and below the middle when a
use leaves the window unreused (whatever it was before: a phase has moved on). The cache
ranks its main region by usage times 1 + the score (history.py, policy.py): of two
experts used alike, the one the optimum keeps stays and the one it lets stream through
goes first. Nothing here changes which experts compute: placement only.

Cost: per use one slice of the occupancy window (numpy), a few microseconds.
"""

from collections import deque

import numpy as np

SCORE_MAX = 7  # a score's ceiling; 0 is its floor
SCORE_NEW = 3  # an expert never trained: just below "the optimum keeps it"
WINDOW_FACTOR = 8  # the window spans this many times the visits a full cache's worth of uses takes


class OptGen:
    """The online replay for `capacity` slots over experts [n_rows, n_expert], trained on
    each visit; `scores` [n_rows, n_expert] int8 is what it has learned (may be given,
    e.g. loaded from the usage history)."""

    def __init__(self, n_rows: int, n_expert: int, capacity: int, top_k: int, scores: np.ndarray | None = None,
                 window: int | None = None):
        self.scores = np.full((n_rows, n_expert), SCORE_NEW, np.int8) if scores is None else scores
        self.last = np.full((n_rows, n_expert), -1, np.int64)  # the moment of each expert's previous use
        self.resize(capacity, top_k, window)
        self.trained = self.kept = 0

    def resize(self, capacity: int, top_k: int, window: int | None = None) -> None:
        """A new number of slots (and window: None, WINDOW_FACTOR times the visits that fill
        the cache): the replay starts its window afresh; the scores stay."""
        self.capacity = max(1, int(capacity))
        self.window = window or max(16, WINDOW_FACTOR * self.capacity // max(1, top_k))
        self.occ = np.zeros(self.window, np.int32)  # kept intervals overlapping each moment
        self.uses: deque[tuple[int, np.ndarray]] = deque()  # (row, ids) of each moment in the window
        self.t = 0
        self.last.fill(-1)

    def visit(self, row: int, ids) -> None:
        """Layer row uses experts `ids` (unique) at the next moment."""
        t, w = self.t, self.window
        self.occ[t % w] = 0
        if len(self.uses) == w:  # the oldest moment leaves the window: uses not reused since go down
            old_row, old_ids = self.uses.popleft()
            stale = old_ids[self.last[old_row, old_ids] == t - w]
            s = self.scores[old_row]
            s[stale] = np.maximum(np.minimum(s[stale], SCORE_NEW), 1) - 1
        ids = np.asarray(ids, np.int64)
        self.uses.append((row, ids))
        prev = self.last[row, ids]
        self.last[row, ids] = t
        s = self.scores[row]
        for ie, t0 in zip(ids.tolist(), prev.tolist()):
            if t0 < 0 or t - t0 >= w:
                continue
            a, b = t0 % w, t % w  # the moments t0 .. t - 1, wrapped
            span = (self.occ[a:b],) if a < b else (self.occ[a:], self.occ[:b])
            self.trained += 1
            if all(part.max(initial=0) < self.capacity for part in span):
                for part in span:
                    part += 1
                self.kept += 1
                s[ie] = min(SCORE_MAX, s[ie] + 1)
            else:
                s[ie] = max(0, s[ie] - 1)
        self.t = t + 1

    def describe(self) -> dict:
        return {"capacity": self.capacity, "window_visits": self.window, "trained": self.trained,
                "optimum_kept": round(self.kept / self.trained, 3) if self.trained else None}
