"""Where the engine gets routed experts from: the ExpertSource interface.

The engine asks for the union of one layer's selected experts at once
(`stream(il, ids)`), so a source reads each expert once per step however many tokens
route to it. The source hands them out in batches, in any order: the resident ones
first, the rest as they arrive from disk. A batch's weights stay valid until the engine
asks for the next batch, so the engine may compute a batch's experts in parallel.
`ResidentExperts` keeps every expert in RAM; the expert cache (cache.py) streams them
from a container under a byte budget. This module is the engine's one door into storage.
"""

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Protocol

from .formats import FORMATS, PLAIN_CODES, fp8, ggml, mxfp4
from .fpformats import (
    BLOCKS,
    FP8_DTYPES,
    SCALES,
    check_finite,
    check_fp8_scales,
    fp8_scale_shape,
    mxfp4_pair,
    scales_f32,
)
from .quant import Expert, QuantWeight, dequantize, int4_of, take_rows
from .safetensors import bf16_to_f32

# the engine's one door into storage: the weights' types and their formats come through it too
__all__ = ["Expert", "ExpertSource", "ExpertStats", "ExpertWeights", "LocalSource", "QuantWeight", "ResidentExperts",
           "TracedSource", "bf16_to_f32", "int4_of", "dequantize", "take_rows", "FORMATS", "PLAIN_CODES", "fp8", "ggml",
           "mxfp4",
           "BLOCKS", "SCALES", "mxfp4_pair", "FP8_DTYPES", "check_finite", "check_fp8_scales", "fp8_scale_shape",
           "scales_f32"]

# (gate [I, D], up [I, D], down [D, I]): arrays in storage precision (bf16 as uint16: see
# bf16_to_f32), or QuantWeight
ExpertWeights = tuple


@dataclass
class ExpertStats:
    steps: int = 0  # forward steps
    fetches: int = 0  # layer-steps served
    experts: int = 0  # experts served, each unique expert of a layer-step once
    routed: int = 0  # experts the step's sequences routed to, each sequence's own set counted: routed /
    # experts is the batch-union saving (1.0 for one sequence at a time)
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0
    io_wait_s: float = 0.0  # time the engine waited for reads
    io_wall_s: float = 0.0  # time with reads in flight
    moe_s: float = 0.0  # time in the routed-expert part of the layers, waiting included (the engine adds it)
    prefetch_issued: int = 0  # reads started ahead of the router (router lookahead)
    prefetch_used: int = 0  # of those, experts the real router chose
    prefetch_wasted: int = 0  # of those, experts it did not choose (they stay resident)
    repins: int = 0  # experts moved into the learned hot set
    verified: int = 0  # reads checked against the manifest's checksum
    verify_s: float = 0.0  # time spent checking (on the I/O threads)
    read_errors: int = 0  # failed or corrupted read attempts (each retried, then the other drives)
    read_requests: int = 0  # reads issued to the drives: one per record, or one for a run of adjacent records

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = round(self.hits / self.experts, 4) if self.experts else None
        d["union_saving"] = round(self.routed / self.experts, 4) if self.experts else None
        d["read_gbs"] = round(self.bytes_read / self.io_wall_s / 1e9, 3) if self.io_wall_s else None
        used, settled = self.prefetch_used, self.prefetch_used + self.prefetch_wasted
        d["prefetch_precision"] = round(used / settled, 4) if settled else None
        for k in ("io_wait_s", "io_wall_s", "moe_s", "verify_s"):
            d[k] = round(d[k], 6)
        return d

    def minus(self, before: "ExpertStats") -> "ExpertStats":
        return ExpertStats(**{k: v - getattr(before, k) for k, v in asdict(self).items()})

    def copy(self) -> "ExpertStats":
        return ExpertStats(**asdict(self))


class ExpertSource(Protocol):
    """Everything the engine asks of its experts, and nothing more."""

    stats: ExpertStats
    int4_group: int | None  # the group size when the experts are int4 (the engine's kernels follow it)
    lookahead: bool  # whether the engine should predict the next MoE layer's experts and call prefetch
    activations: str  # "float32", or "int8" (MoEModel.set_activations sets it; absent: float32)

    def begin_step(self) -> None:
        """A new forward step starts (for stats, the usage history and traces)."""

    def stream(self, il: int, ids: list[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Batches of (id, weights) covering each of `ids` (unique) of layer il once, in any
        order; a batch's weights are valid until the next batch is asked for."""
        ...

    def prefetch(self, il: int, ids: list[int], tokens: int = 1) -> int:
        """The router lookahead predicts `ids` for layer il from a step of `tokens` tokens:
        start what reads the source wants to (data moves only; stream still serves exactly
        what it is asked). Returns the reads started."""
        ...

    def layer_done(self, il: int, routed: int, moe_s: float) -> None:
        """The engine finished layer il's experts: `routed` experts were asked for, each
        sequence's own set counted (routed / experts is the batch-union saving), in `moe_s`
        seconds, waiting included."""

    def int4_hits(self, il: int, ids: list[int]) -> tuple | None:
        """When every one of `ids` (unique) of layer il is resident as int4 without biases:
        (group size, record layouts, [len(ids), 6] addresses) for the crew's decode job,
        counted as stream() would count them; else None, and the engine takes stream()."""
        ...

    def compute_into(self, il: int, rows_of: list, x, w_flat, prompt_rows, A: int, ys, compute, ffn=None,
                     clamped=None) -> bool:
        """Compute the step's experts of layer il itself (some of them elsewhere: the Ray
        boxes), writing their rows of `ys`; `compute` is the engine's own path for the
        rest. False: the engine streams and computes them all (every local source)."""
        ...

    def describe(self) -> dict:
        """Facts about the placement for status and stats."""
        ...


class LocalSource:
    """What an expert source that neither hands out int4 addresses nor computes elsewhere
    answers (the protocol's optional capabilities, declined)."""

    def int4_hits(self, il: int, ids: list[int]) -> tuple | None:
        return None

    def compute_into(self, il, rows_of, x, w_flat, prompt_rows, A, ys, compute, ffn=None, clamped=None) -> bool:
        return False


class ResidentExperts(LocalSource):
    """Every routed expert read into RAM at open (the all-resident placement).

    `names(il, ie)` gives the tensor names of (gate, up, down) in `src` (a Checkpoint).
    Raises what src.read raises.
    """

    def __init__(self, src, layers: list[int], n_expert: int, names):
        self.experts: dict[int, list[ExpertWeights]] = {
            il: [tuple(src.read_weight(n) for n in names(il, ie)) for ie in range(n_expert)] for il in layers
        }
        self.stats = ExpertStats()
        self.by_layer = dict.fromkeys(layers, 0)  # experts served per layer (all hits)

    int4_group = None  # a checkpoint's experts are bf16, f16, f32, FP8 or MXFP4
    lookahead = False  # nothing to read ahead

    def begin_step(self) -> None:
        self.stats.steps += 1

    def prefetch(self, il: int, ids: list[int], tokens: int = 1) -> int:
        return 0

    def layer_done(self, il: int, routed: int, moe_s: float) -> None:
        self.stats.routed += routed
        self.stats.moe_s += moe_s

    def stream(self, il: int, ids: list[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
        self.stats.fetches += 1
        self.stats.experts += len(ids)
        self.stats.hits += len(ids)
        self.by_layer[il] += len(ids)
        layer = self.experts[il]
        yield [(ie, layer[ie]) for ie in ids]

    def expert_map(self) -> dict:
        """Every expert resident (c); heat: none kept (the map shows the routing live)."""
        return {"where": ["c" * len(experts) for _, experts in sorted(self.experts.items())],
                "heat": [[0.0] * len(experts) for _, experts in sorted(self.experts.items())]}

    def layer_stats(self) -> list[dict]:
        """Per MoE layer: hits (every expert is one), misses and bytes read (none)."""
        return [{"layer": il, "hits": n, "misses": 0, "bytes_read": 0} for il, n in sorted(self.by_layer.items())]

    @property
    def n_bytes(self) -> int:
        return sum(a.nbytes for layer in self.experts.values() for e in layer for a in e)

    def describe(self) -> dict:
        first = next(iter(self.experts.values()), [()])[0]  # a published format's kind (fp8_e4m3, mxfp4), else None
        kind = first[0].kind if first and isinstance(first[0], QuantWeight) else None
        return {"placement": "all resident", "expert_bytes": self.n_bytes, "experts_kind": kind}


class TracedSource(LocalSource):
    """Wraps a source and writes one JSON line per layer per forward step:
    {"step": i, "layer": l, "experts": [...]} (a prefill step lists the union), with
    "predicted": [...] when the router lookahead predicted that layer's experts (the
    model computes the prediction whenever it is traced, prefetching or not). Every step
    goes through stream(), so that the trace sees it (int4_hits declined)."""

    lookahead = True

    def __init__(self, inner: ExpertSource, out):
        self.inner, self.out, self.step = inner, out, -1
        self.predicted: dict[int, list[int]] = {}
        self.int4_group = inner.int4_group

    @property
    def stats(self) -> ExpertStats:
        return self.inner.stats

    def begin_step(self) -> None:
        self.step += 1
        self.predicted.clear()
        self.inner.begin_step()

    def prefetch(self, il: int, ids: list[int], tokens: int = 1) -> int:
        self.predicted[il] = [int(i) for i in ids]
        return self.inner.prefetch(il, ids, tokens) if self.inner.lookahead else 0

    def stream(self, il: int, ids: list[int]):
        line = {"step": self.step, "layer": il, "experts": [int(i) for i in ids]}
        if il in self.predicted:
            line["predicted"] = self.predicted.pop(il)
        self.out.write(json.dumps(line) + "\n")
        return self.inner.stream(il, ids)

    def layer_done(self, il: int, routed: int, moe_s: float) -> None:
        self.inner.layer_done(il, routed, moe_s)

    def describe(self) -> dict:
        return self.inner.describe()
