"""Expert cache policies: what stays resident beyond plain per-layer LRU.

A policy is a name and a few numbers (Policy); the cache (cache.py) does the moving,
the policy only decides. The same decisions drive the replay in bench/cache_policy.py,
so what the benchmark measures is what the daemon does.

- `lru`: each MoE layer keeps an equal share of the budget as an LRU. Hand pins
  (`colictl pin`) still hold.
- `lru+pinned`: part of the budget (`hot_set`, a fraction of what is left above the LRU
  minimum of top-k slots per layer) holds the hottest experts of the usage history
  (history.py), across layers, wherever they are; the rest is the per-layer LRU. At
  start the hot set is read from the history; every `repin_every` steps it is revised
  with hysteresis: an expert resident in the LRU part replaces the coldest learned pin
  only when its count exceeds that pin's by the factor 1 + `repin_margin`, so the set
  does not churn on noise. Hand pins are never repinned away.
- `learned` (the default), after W-TinyLFU: each layer keeps a small LRU window (top-k
  slots, at most a quarter of its share) for what it just used, and the rest of the
  budget is one main region for all layers, kept by usage. An expert leaving a window
  enters the main region if there is room or if its decayed usage count (history.py)
  beats that of the main region's least used expert, which then leaves instead. So
  frequent experts stay, a layer that routes widely gets more room than one that routes
  narrowly, one-off experts pass through the windows without flushing anything, and the
  decay (half-life in steps) lets the region follow a workload that drifts. A step
  whose misses outnumber its layer's window borrows main-region slots (free ones, or
  those of experts used less than the one to read) so its reads still run in parallel,
  and gives them back after the step. At start the main region is filled from the
  history. In the replay of the synthetic model's traces
  this is the policy closest to Belady's optimum (bench/cache_policy.py).
- `learned-opt`: `learned`'s window and main region, ranked by usage weighed by what
  Belady's optimum would have done (after Hawkeye, ISCA 2016; optgen.py): the cache
  replays the optimum for its own number of slots over a sliding window of the recent
  past, and each expert's score goes up when the optimum kept it from one use to the next
  and down when it did not (or when a use leaves the window unreused). An expert's worth
  is its decayed count times 1 + its score, so one the optimum lets stream through stays
  in its layer's window and is not admitted over one it keeps (bypass), and a workload
  that moves on drops its old experts sooner than counts alone would. The scores are kept
  in the usage history: a restart keeps what was learned. On the trace library it is
  level with `learned` (bench/cache_policy.py, docs/benchmarks.md), which stays the
  default.
- `prefetch_reads` > 0 adds the router lookahead (model.py) to either: at most that
  many reads of the next layer's predicted experts in flight for each token of the step
  (a prompt's predicted union is read ahead whole, as slots allow).

Placement decides speed, never semantics: a policy moves bytes between disk and RAM;
the router alone decides which experts compute.
"""

from dataclasses import asdict, dataclass, replace

POLICIES = ("lru", "lru+pinned", "learned", "learned-opt")


class PolicyInvalid(ValueError):
    """A policy name or setting that is not valid (the message names it)."""


@dataclass(frozen=True)
class Policy:
    name: str = "learned"
    hot_set: float = 0.5  # learned pins: this fraction of the slots above the LRU minimum
    repin_every: int = 32  # forward steps between hot set revisions (0: only at start)
    repin_margin: float = 0.25  # a challenger's count must exceed the coldest pin's by this factor
    prefetch_reads: int = 8  # router lookahead reads in flight for the next layer, per token of the step (0: off)

    @property
    def learns(self) -> bool:
        """Whether it keeps a learned (pinned) hot set."""
        return self.name == "lru+pinned"

    @property
    def windowed(self) -> bool:
        """Whether each layer keeps a small recency window and the rest of the budget is one
        main region kept by worth (else per-layer LRU shares)."""
        return self.name in ("learned", "learned-opt")

    @property
    def learns_optimum(self) -> bool:
        """Whether the main region is ranked by what Belady's optimum taught (optgen.py)."""
        return self.name == "learned-opt"

    def check(self) -> "Policy":
        """Raise PolicyInvalid naming the first bad setting; return self."""
        if self.name not in POLICIES:
            raise PolicyInvalid(f"policy {self.name!r} is not one of {', '.join(POLICIES)}")
        if not 0.0 <= self.hot_set <= 1.0:
            raise PolicyInvalid(f"hot_set = {self.hot_set!r} must be a fraction between 0 and 1")
        if self.repin_every < 0:
            raise PolicyInvalid(f"repin_every = {self.repin_every!r} must be at least 0")
        if self.repin_margin < 0:
            raise PolicyInvalid(f"repin_margin = {self.repin_margin!r} must be at least 0")
        if self.prefetch_reads < 0:
            raise PolicyInvalid(f"prefetch_reads = {self.prefetch_reads!r} must be at least 0")
        return self

    def with_settings(self, settings: dict) -> "Policy":
        """A copy with `settings` (key -> value, from the config or `colictl policy set`;
        strings are parsed). Raises PolicyInvalid for an unknown key or a bad value."""
        kinds = {"name": str, "policy": str, "hot_set": float, "repin_every": int, "repin_margin": float,
                 "prefetch_reads": int, "prefetch": int}
        out = {}
        for key, value in settings.items():
            if key not in kinds:
                raise PolicyInvalid(f"unknown policy setting {key!r} (known: policy, hot_set, repin_every, "
                                    "repin_margin, prefetch_reads)")
            kind = kinds[key]
            if kind is not str and isinstance(value, str):
                v = value.strip().lower()
                if key in ("prefetch", "prefetch_reads") and v in ("off", "on"):
                    value = 0 if v == "off" else 8
                else:
                    try:
                        value = kind(v)
                    except ValueError:
                        raise PolicyInvalid(f"{key} = {value!r} is not a{'n integer' if kind is int else ' number'}") \
                            from None
            if kind is str and not isinstance(value, str) or kind is not str and (
                    isinstance(value, bool) or not isinstance(value, int | float)):
                raise PolicyInvalid(f"{key} = {value!r} has the wrong type")
            if kind is int and value != int(value):
                raise PolicyInvalid(f"{key} = {value!r} is not an integer")
            out[{"policy": "name", "prefetch": "prefetch_reads"}.get(key, key)] = kind(value)
        return replace(self, **out).check()

    def as_dict(self) -> dict:
        return asdict(self)


def learned_slots(policy: Policy, total_slots: int, n_moe: int, top_k: int, n_expert: int) -> int:
    """How many of `total_slots` the learned hot set gets: its fraction of those above
    the LRU minimum (top_k slots per MoE layer); 0 when the policy does not pin or when
    every expert fits anyway."""
    if not policy.learns or total_slots >= n_moe * n_expert:
        return 0
    spare = total_slots - n_moe * top_k
    return max(int(spare * policy.hot_set), 0)


def plan_repin(value, learned: list, challengers: list, free: int, margin: float) -> list[tuple]:
    """Revise the learned hot set. value((il, ie)) -> its usage count; `learned`: the
    current learned pins; `challengers`: experts that could be pinned now (resident, not
    pinned); `free`: empty pinned slots. Returns [(add, drop)]: pin `add`, unpinning
    `drop` (None: into a free slot). Hysteresis: a challenger displaces a pin only when
    its count is more than (1 + margin) times the pin's."""
    ranked = sorted((c for c in challengers if value(c) > 0), key=value, reverse=True)
    weakest = sorted(learned, key=value)
    moves, i = [], 0
    for c in ranked[:free]:
        moves.append((c, None))
        i += 1
    j = 0
    for c in ranked[i:]:
        if j >= len(weakest) or value(c) <= (1 + margin) * value(weakest[j]):
            break
        moves.append((c, weakest[j]))
        j += 1
    return moves


def victim(entries, busy):
    """The per-layer LRU's victim (`entries` oldest first): the oldest not `busy` in this
    step, or None when every one is."""
    return next((ie for ie in entries if ie not in busy), None)
