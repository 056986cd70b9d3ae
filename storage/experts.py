"""Where the engine gets routed experts from: the ExpertSource interface.

The engine asks for the union of one layer's selected experts at once
(`fetch(il, ids)`), so an implementation can read each expert once per step however
many tokens route to it. `ResidentExperts` keeps every expert in RAM; the streaming
cache (a byte budget over NVMe reads) implements the same interface.
"""

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .checkpoint import Checkpoint

# (gate [I, D], up [I, D], down [D, I]) in storage precision
ExpertWeights = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass
class ExpertCounters:
    n_fetch: int = 0  # fetch calls (one per MoE layer per forward step)
    n_expert: int = 0  # experts handed out, counting each unique expert of a step once
    per_layer: dict[int, int] = field(default_factory=dict)


class ExpertSource(Protocol):
    def fetch(self, il: int, ids: list[int]) -> list[ExpertWeights]:
        """The weights of experts `ids` (unique) of layer `il`, in the same order."""
        ...


class ResidentExperts:
    """Every routed expert read into RAM at open (the all-resident placement).

    `names(il, ie)` gives the checkpoint tensor names of (gate, up, down). Raises
    what Checkpoint.read raises.
    """

    def __init__(self, ckpt: Checkpoint, layers: list[int], n_expert: int, names):
        self.experts: dict[int, list[ExpertWeights]] = {
            il: [tuple(ckpt.read(n) for n in names(il, ie)) for ie in range(n_expert)] for il in layers
        }
        self.counters = ExpertCounters()

    def fetch(self, il: int, ids: list[int]) -> list[ExpertWeights]:
        self.counters.n_fetch += 1
        self.counters.n_expert += len(ids)
        self.counters.per_layer[il] = self.counters.per_layer.get(il, 0) + len(ids)
        layer = self.experts[il]
        return [layer[ie] for ie in ids]

    @property
    def n_bytes(self) -> int:
        return sum(a.nbytes for layer in self.experts.values() for e in layer for a in e)
