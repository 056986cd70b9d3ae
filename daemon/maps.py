"""The live expert map's data (the gateway's page): where every expert is and how hot
(the expert source's expert_map), and the routing of recent forward steps, so that a
viewer can flash the experts of the token being made and measure co-activation.

RoutingLog wraps the model's expert source and notes each layer's routed union per step
in a bounded ring (a deque append: no work on the engine's path beyond that). The I/O
thread reads the ring's entries after a step a viewer already has.
"""

from collections import deque

LOG_ENTRIES = 1 << 16  # (step, layer, experts) entries kept: about a thousand tokens of a 60-layer model


class RoutingLog:
    """An ExpertSource that passes everything to `inner` and logs the routing."""

    def __init__(self, inner, size: int = LOG_ENTRIES):
        self.inner = inner
        self.log: deque = deque(maxlen=size)
        self.step = 0

    def __getattr__(self, name):  # stats, int4_group, lookahead, describe, layer_stats, ...
        return getattr(self.inner, name)

    def begin_step(self) -> None:
        self.step += 1
        self.inner.begin_step()

    def prefetch(self, il: int, ids: list[int], tokens: int = 1) -> int:
        return self.inner.prefetch(il, ids, tokens)

    def stream(self, il: int, ids: list[int]):
        self.log.append((self.step, il, tuple(int(i) for i in ids)))
        return self.inner.stream(il, ids)

    def int4_hits(self, il: int, ids: list[int]):
        # a step the cache serves from its slots (engine/moe.moe) is a routed step too
        hits = self.inner.int4_hits(il, ids)
        if hits is not None:
            self.log.append((self.step, il, tuple(int(i) for i in ids)))
        return hits

    def compute_into(self, il, rows_of, x, w_flat, prompt_rows, A, ys, compute, ffn=None, clamped=None) -> bool:
        if self.inner.compute_into(il, rows_of, x, w_flat, prompt_rows, A, ys, compute, ffn, clamped):
            self.log.append((self.step, il, tuple(int(ie) for ie, _ in rows_of)))  # a routed step too
            return True
        return False

    def layer_done(self, il: int, routed: int, moe_s: float) -> None:
        self.inner.layer_done(il, routed, moe_s)

    def since(self, step: int) -> list:
        """[step, layer, [experts]] of every logged layer-step after `step` (oldest first)."""
        return [[s, il, list(ids)] for s, il, ids in list(self.log) if s > step]


def snapshot(model, log: RoutingLog, since: int | None) -> dict:
    """The map's state: the layers, experts, where and heat, the step, and the routing
    after step `since` (None: only the latest step's)."""
    m = model.experts.expert_map()
    last = log.step if since is None else since
    routing = log.since(last - 1 if since is None else last)
    return {"layers": list(model.moe_layers), "n_expert": model.n_expert, "step": log.step, **m,
            "routing": routing}
