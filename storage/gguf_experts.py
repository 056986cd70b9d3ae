"""A GGUF file's routed experts streamed from the file itself, under an expert budget, as a
container's records are (storage/cache.py, storage/reader.py): no conversion, no copy.

llama.cpp stacks a layer's experts in three tensors (`blk.L.ffn_gate_exps`, `_up_exps`,
`_down_exps`, [n_expert, rows, row bytes]), so expert e of a layer is three contiguous
slices, one in each, 32-byte aligned in the file (GGUF's alignment), in whichever part of a
split set holds its tensor. Each expert is a record of three extents: each slice's
enclosing 4 KiB range, read with O_DIRECT into its own 4 KiB-aligned region of a slot, the
matrix's view starting where the slice starts inside it. The slot is the largest such
record of the model (a few KiB more than the expert's bytes); the bytes read and counted
are the record's own.

A GGUF file carries no checksums: its experts are read unchecked ("no checksums", as a
checkpoint's), what a container's manifest adds (colictl convert) when that matters.
"""

import os

import numpy as np

from .container import ALIGN, ExpertRecord, Extent, round_up
from .formats import ggml
from .gguf import FLOAT_TYPES, block_shape, block_weight, kinds_label
from .quant import Expert


class GGUFExperts:
    """The experts of `gguf` (an opened GGUFCheckpoint, its names those of `model`'s family)
    with the interface storage/cache.ExpertCache reads a container's through: records,
    record_bytes, expert_views, the model's MoE layers. Raises what GGUFCheckpoint.expect
    raises for an expert tensor (checked by placement first)."""

    views_per_record = True  # each expert's matrices start where its slices fall in their pages
    extents = True  # three reads an expert
    checksums = False
    group_size = None  # (no int4 group, no scale block: the blocks carry their scales)
    block = None

    def __init__(self, gguf, model):
        from .convert import fingerprint

        self.gguf = gguf
        first = next(iter(gguf.files.values())).path
        self.path = os.path.dirname(os.path.abspath(first))  # the drive the files are on (drives.py)
        self.fingerprint = fingerprint(gguf)
        self.moe_layers, self.n_expert = list(model.moe_layers), model.n_expert
        sizes = {p.path: p.file_bytes for p in gguf.files.values()}
        self.records: dict[tuple[int, int], ExpertRecord] = {}
        self.parts: dict[tuple[int, int], tuple] = {}  # (il, ie) -> ((offset in the slot, GGUF type, shape), ...)
        kinds, slices = set(), 0
        for il in self.moe_layers:
            for ie in range(self.n_expert):
                extents, parts, at = [], [], 0
                for name in model.expert_names(il, ie):
                    e, file = gguf.entry(name), os.path.abspath(gguf.file_of(name))
                    lo, hi = e.begin // ALIGN * ALIGN, round_up(e.end, ALIGN)
                    extents.append(Extent(file, lo, hi - lo, at, min(hi, sizes[gguf.file_of(name)]) - lo))
                    parts.append((at + e.begin - lo, e.dtype, tuple(e.shape)))
                    kinds.add(e.dtype)
                    slices += e.end - e.begin
                    at += hi - lo
                x = extents[0]
                self.records[(il, ie)] = ExpertRecord(il, ie, x.file, x.offset, sum(x.length for x in extents), None,
                                                      tuple(extents))
                self.parts[(il, ie)] = tuple(parts)
        self.record_bytes = max(r.length for r in self.records.values())
        # the experts' number formats, as precision() names them: q4_k, q4_k+q6_k (Q4_K_M), f32, ...
        self.expert_dtype = kinds_label(kinds)
        self.dense_bytes = sum(p.file_bytes for p in gguf.files.values()) - slices

    def expert_views(self, record: np.ndarray, key: tuple[int, int]) -> Expert:
        """(gate, up, down), then the biases, of expert `key` over its slot's bytes, zero-copy:
        a block format's QuantWeight over its blocks, a float type's array."""
        out = []
        for at, dtype, shape in self.parts[key]:
            if dtype in ggml.BY_TYPE_NAME:
                rows, row_bytes = block_shape(dtype, shape)
                out.append(block_weight(dtype, record[at:at + rows * row_bytes].reshape(rows, row_bytes)))
            else:
                dt = np.dtype(FLOAT_TYPES[dtype])
                out.append(record[at:at + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape))
        return Expert(out)

    @property
    def expert_bytes(self) -> int:  # (as slots hold them, like a container's)
        return self.record_bytes * len(self.records)

