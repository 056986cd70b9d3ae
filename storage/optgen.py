"""Belady's optimum replayed online, and what each expert learns from it (`learned-opt`).

After Hawkeye's OPTgen (Jain and Lin, ISCA 2016): over a sliding window of the recent
past, for every reuse of an expert, would the optimal cache of the same number of slots
still have held it since its previous use? The optimal (bypassing) cache keeps an expert
from one use to the next exactly when, at every moment in between, fewer than `capacity`
other kept intervals overlap; an occupancy count per moment of the window answers that
in one pass over the moments between the two uses. Time here is a layer visit: each
`visit(row, ids)` (a MoE layer routing a step's experts) is one moment, and its experts
are used at it.

Each (layer, expert) keeps a saturating score (0 .. SCORE_MAX): up when the optimum kept
it from its previous use to this one, down when it did not, and below the middle when a
use leaves the window unreused (whatever it was before: a phase has moved on). The cache
ranks its main region by usage times 1 + the score (history.py, policy.py): of two
experts used alike, the one the optimum keeps stays and the one it lets stream through
goes first. Nothing here changes which experts compute: placement only.

Cost: per use a pass over the occupancy window between its two uses (compiled), about a
microsecond.
"""

from collections import deque

import numba as nb
import numpy as np

SCORE_MAX = 7  # a score's ceiling; 0 is its floor
SCORE_NEW = 3  # an expert never trained: just below "the optimum keeps it"
_NONE = np.zeros(0, np.int64)
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
        old_row, old_ids = self.uses.popleft() if len(self.uses) == w else (0, _NONE)
        ids = np.asarray(ids, np.int64)
        self.uses.append((row, ids))
        kept, trained = _visit(self.occ, self.last, self.scores, row, ids, t, self.capacity, old_row, old_ids)
        self.kept, self.trained, self.t = self.kept + kept, self.trained + trained, t + 1

    def describe(self) -> dict:
        return {"capacity": self.capacity, "window_visits": self.window, "trained": self.trained,
                "optimum_kept": round(self.kept / self.trained, 3) if self.trained else None}


@nb.njit(cache=True, nogil=True)
def _visit(occ, last, scores, row, ids, t, capacity, old_row, old_ids):
    # moment t: the uses old_ids of layer row old_row at moment t - window leave the window
    # (those not reused since go below the middle); then the uses `ids` of layer row `row`,
    # each reuse within the window kept by the optimum (occupancy below capacity from its
    # previous use on) or not -> (kept, trained)
    w = occ.shape[0]
    occ[t % w] = 0
    for ie in old_ids:
        if last[old_row, ie] == t - w:
            scores[old_row, ie] = max(min(scores[old_row, ie], SCORE_NEW), 1) - 1
    kept = trained = 0
    for ie in ids:
        t0 = last[row, ie]
        last[row, ie] = t
        if t0 < 0 or t - t0 >= w:
            continue
        trained += 1
        fits = True
        for m in range(t0, t):
            if occ[m % w] >= capacity:
                fits = False
                break
        if fits:
            for m in range(t0, t):
                occ[m % w] += 1
            kept += 1
            scores[row, ie] = min(SCORE_MAX, scores[row, ie] + 1)
        else:
            scores[row, ie] = max(0, scores[row, ie] - 1)
    return kept, trained
