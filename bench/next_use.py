"""`next-use`, a policy studied in the replay only (bench/cache_policy.py reports it next to
the cache's own): not in the expert cache, because on the trace library it does not beat
`learned` (docs/benchmarks.md, "Cache policies"). Kept so the comparison can be rerun and
the idea taken further.

One pool of experts of all MoE layers kept by predicted next use, with bypass; its
timescale picked by replaying candidates in shadow caches; a shared recency window of one
token's experts, which a live cache needs anyway for the reads of experts it does not keep.
"""

from collections import OrderedDict

import numpy as np


class NextUse:
    """The `next-use` policy's decisions: a pool of `capacity` experts of all MoE layers kept
    by predicted next use, and a shared recency window of `window` slots that every expert
    the pool does not admit passes through; its timescale learned by replaying candidates.
    access() returns the decisions a cache would carry out slot by slot.

    Belady keeps the experts needed soonest and lets one needed later than all of them
    stream through without being kept. Online, the next use is predicted: each (layer,
    expert) keeps its rate of use per step, an exponential average over recent steps; at a
    per-step probability p its next use is expected in (1 - p) / p more steps, counted in
    layer lines from the current layer (the next layers' experts come before this one's).
    A miss evicts the pool's expert predicted farthest when the newcomer is predicted
    sooner; otherwise the newcomer goes into the window (its least recent leaves), where a
    second use finds it and may promote it the same way. The window is what an expert
    needs to prove it is more than a one-off (W-TinyLFU's window, shared by the layers as
    they run one at a time); it is also where the reads of experts not kept land.

    Which timescale predicts best depends on the workload and the budget (a small budget
    wants the last few steps: topic bursts; a large one the long-run popularity): on the
    routing traces of five families the best half-life ranged from 2 to 512 steps. So a
    shadow cache per candidate replays every access on metadata alone, and the live
    decisions follow the candidate whose shadow has hit most over the recent past.

    Keys are line-major: key = layer position * n_expert + expert."""

    HALF_LIVES = (2, 8, 32, 128, 512, 4096)  # steps
    SCORE_DECAY = 0.9999  # per access: the shadows' hit counts forget over ~10^4 accesses
    # what access() tells the cache for each expert of a line
    HIT, WINDOW_HIT, PROMOTE, ADMIT, WINDOW, STREAM = "hit", "window-hit", "promote", "admit", "window", "stream"

    def __init__(self, n_layers: int, n_expert: int, capacity: int, window: int, half_lives=HALF_LIVES):
        self.L, self.E = n_layers, n_expert
        N = n_layers * n_expert
        self.g = np.array([2.0 ** (-1.0 / h) for h in half_lives])  # [H] per-step decay
        self.half_lives = tuple(half_lives)
        self.counts = np.zeros((len(half_lives), N))  # [H, N] uses, in units of self.weight (lazy decay)
        self.weight = np.ones(len(half_lives))  # [H] what one use adds now: grows by 1 / g per step
        self.layer_of = np.repeat(np.arange(n_layers), n_expert)  # [N]
        self.score = np.zeros(len(half_lives))  # [H] decayed shadow hits
        self.hits = self.misses = 0
        self.resize(capacity, window)

    def resize(self, capacity: int, window: int) -> None:
        """New sizes (the shadows start empty; the live pool and window as the cache sets
        them: `live_pool`, `live_window`)."""
        self.cap, self.win = max(capacity, 0), max(window, 0)
        H, N = len(self.half_lives), self.L * self.E
        self.pools = np.zeros((H + 1, N), bool)  # [H + 1, N] residents: each candidate's shadow, then the live pool
        self.windows = [OrderedDict() for _ in range(H + 1)]  # key -> True, least recent first

    @property
    def choice(self) -> int:
        return int(np.argmax(self.score))

    def step(self) -> None:
        """A forward step has begun."""
        self.weight /= self.g
        if self.weight.max() > 1e100:
            self.counts /= self.weight[:, None]
            self.weight[:] = 1.0

    def rates(self, h: int, keys) -> np.ndarray:
        # candidate h's per-step use probability of `keys`
        return np.clip(self.counts[h, keys] / self.weight[h] * (1.0 - self.g[h]), 1e-4, 0.999)

    def _lines(self, h: int, keys, li: int) -> np.ndarray:
        # candidate h's expected layer lines from layer position li to the next use of `keys`
        p = self.rates(h, keys)
        ahead = (self.layer_of[keys] - li - 1) % self.L + 1  # this layer's: next step at the soonest
        return ahead + self.L * (1.0 - p) / p

    def _serve(self, h: int, who: int, keys: list[int], li: int, out: list | None, known: dict) -> int:
        # one line's keys through cache `who` (a shadow, or the live one: H) with candidate h's
        # predictions; appends (key, action, evicted key or None) to `out`; returns the hits
        pool, win = self.pools[who], self.windows[who]
        now = set(keys)
        hits = 0
        lines = None  # the pool's residents and their predicted next use, computed when first needed
        say = out.append if out is not None else (lambda decision: None)

        def farthest():
            nonlocal lines
            if lines is None:
                res = np.flatnonzero(pool)
                lines = (res, np.where(np.isin(res, keys), -1.0, self._lines(h, res, li)))
                for j in np.flatnonzero(np.isin(res, list(known))) if known else ():
                    if lines[1][j] >= 0:
                        lines[1][j] = known[int(res[j])]
            if not len(lines[0]):
                return None, None
            j = int(np.argmax(lines[1]))
            return j, lines[1][j]

        def swap_in(k, j):  # key k takes pool entry j's place
            nonlocal lines
            out_k = int(lines[0][j])
            pool[out_k], pool[k] = False, True
            lines[0][j], lines[1][j] = k, -1.0
            return out_k

        for k in keys:
            if pool[k]:
                hits += 1
                say((k, self.HIT, None))
                continue
            # the newcomer, used now: its next use after this one
            p = np.clip((self.counts[h, k] + self.weight[h]) / self.weight[h] * (1.0 - self.g[h]), 1e-4, 0.999)
            mine = known.get(k, self.L * (1.0 - p) / p + self.L) if known else self.L * (1.0 - p) / p + self.L
            if k in win:
                hits += 1
                win.move_to_end(k)
                j, far = farthest() if self.cap and pool.sum() >= self.cap else (None, None)
                if j is not None and far > mine:  # promoted: the pool's farthest leaves
                    del win[k]
                    say((k, self.PROMOTE, swap_in(k, j)))
                elif self.cap and pool.sum() < self.cap:
                    del win[k]
                    pool[k] = True
                    lines = None
                    say((k, self.PROMOTE, None))
                else:
                    say((k, self.WINDOW_HIT, None))
                continue
            if self.cap and pool.sum() < self.cap:
                pool[k] = True
                lines = None
                say((k, self.ADMIT, None))
                continue
            j, far = farthest() if self.cap else (None, None)
            if j is not None and far > mine:
                say((k, self.ADMIT, swap_in(k, j)))
                continue
            old = next((w for w in win if w not in now), None) if len(win) >= self.win else None
            if len(win) >= self.win and old is None:  # the window holds only this line's experts
                say((k, self.STREAM, None))
                continue
            if old is not None:
                del win[old]
            win[k] = True
            say((k, self.WINDOW, old))
        return hits

    def access(self, li: int, experts, known: dict | None = None) -> list[tuple[int, str, int | None]]:
        """Layer position li's experts (unique) in this step. Returns the live cache's
        decisions, in order: (key, action, evicted key or None). `known` {key: lines to its
        next use}: next uses given instead of predicted (an oracle, to bound what foresight
        would gain; for a newcomer, its next use after this one)."""
        known = known or {}
        keys = [li * self.E + int(e) for e in experts]
        chosen, out = self.choice, []
        for h in range(len(self.half_lives)):
            n = self._serve(h, h, keys, li, None, known)
            self.score[h] = self.score[h] * self.SCORE_DECAY ** len(keys) + n
        live = self._serve(chosen, len(self.half_lives), keys, li, out, known)
        self.counts[:, keys] += self.weight[:, None]
        self.hits += live
        self.misses += len(keys) - live
        return out


def next_use_split(slots: int, top_k: int) -> tuple[int, int]:
    """`next-use`'s (pool, window) slots out of `slots`: the window holds one token's
    experts of a layer (so a decode step's reads of experts not kept run in parallel), at
    most a quarter of the slots, at least one."""
    window = max(1, min(top_k, slots // 4))
    return slots - window, window
