"""gpt-oss (`gpt_oss`): grouped-query attention with q/k/v/o biases and attention sinks,
sliding-window and full layers as `layer_types` says, YaRN; a router with a bias whose
top-k logits are softmaxed; experts with biases and the clamped SwiGLU
(`swiglu_limit`, `swiglu_alpha`: out = (clip(up) + 1) * g * sigmoid(alpha * g), g = gate
capped at the limit).

The checkpoints store each layer's experts fused: `gate_up_proj` [E, D, 2I] with gate and
up interleaved by column, `down_proj` [E, I, D], and their biases. `source()` presents
them as one (gate [I, D], up [I, D], down [D, I], gate_bias, up_bias, down_bias) per
expert (`FusedExperts`), so loading, checking and converting read experts one by one as
for every family, and a container keeps each expert in one record. The published
checkpoints hold the fused matrices in MXFP4 (quant_method mxfp4): `gate_up_proj_blocks`
[E, 2I, D/32, 16] and `_scales` [E, 2I, D/32] (rows gate, up, gate, up, ...), `down_proj_blocks`
[E, D, I/32, 16] and `_scales`: already [out, in], so an expert's gate is every other row,
kept in MXFP4 (storage/fpformats.py).
"""

from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from ...storage.experts import BLOCKS, SCALES, QuantWeight, mxfp4, mxfp4_pair
from ..attention import AttnSpec, attention
from ..layers import linear, rmsnorm, to_f32
from ..model import HF_NAMES, MoEModel, check_moe_args, require
from ..moe import moe

MODEL_TYPE = "gpt_oss"
ALIASES = {"num_local_experts": ("num_experts",)}


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 2880
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    sliding_window: int = 128
    layer_types: list | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if (il + 1) % 2 else "full_attention"
                                for il in range(self.num_hidden_layers)]
        require(len(self.layer_types) == self.num_hidden_layers, "layer_types needs one entry per layer")
        check_moe_args(self, self.num_local_experts)


EXPERTS = "model.layers.{il}.mlp.experts."
NAMES = HF_NAMES | {
    "router": "model.layers.{il}.mlp.router.weight",
    "router_bias": "model.layers.{il}.mlp.router.bias",
    "sinks": "model.layers.{il}.self_attn.sinks",
    # one expert's view of the fused tensors (FusedExperts): these names are not in the files
    "expert_gate_bias": EXPERTS + "{ie}.gate_proj.bias",
    "expert_up_bias": EXPERTS + "{ie}.up_proj.bias",
    "expert_down_bias": EXPERTS + "{ie}.down_proj.bias",
}
FUSED = {"gate_up": EXPERTS + "gate_up_proj", "gate_up_bias": EXPERTS + "gate_up_proj_bias",
         "down": EXPERTS + "down_proj", "down_bias": EXPERTS + "down_proj_bias"}
# an expert's piece -> the fused tensor it comes from
PIECE_OF = {"gate": "gate_up", "up": "gate_up", "down": "down", "gate_b": "gate_up_bias", "up_b": "gate_up_bias",
            "down_b": "down_bias"}


def route(logits: np.ndarray, n_expert_used: int) -> tuple[np.ndarray, np.ndarray]:
    # logits [T, E] (the router's bias added) -> ids [T, A], weights [T, A]: the top-k logits,
    # softmaxed among themselves
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :n_expert_used]  # [T, A]
    top = np.take_along_axis(logits, ids, axis=-1)  # [T, A]
    e = np.exp(top - top.max(-1, keepdims=True))
    return ids, (e / e.sum(-1, keepdims=True)).astype(np.float32)


class FusedExperts:
    """A gpt-oss checkpoint with its fused expert tensors shown one expert at a time under
    the per-expert names of NAMES: `read` slices, de-interleaves and transposes (exact, in
    the storage dtype); everything else is the checkpoint's."""

    def __init__(self, checkpoint, model: "Model"):
        self.ckpt, self.model = checkpoint, model
        self.virtual = {}  # per-expert name -> (fused key, layer, expert, which)
        for il in model.moe_layers:
            for ie in range(model.n_expert):
                for name, which in zip(model.expert_names(il, ie), ("gate", "up", "down", "gate_b", "up_b", "down_b")):
                    self.virtual[name] = (il, ie, which)
        self._cache: dict = {}  # (layer, fused key) -> the fused tensor, while its layer's experts are read
        self.mxfp4 = checkpoint.quant is not None and checkpoint.quant.method == "mxfp4"

    def __getattr__(self, name):
        return getattr(self.ckpt, name)

    def _fused(self, il: int, key: str) -> np.ndarray:
        # a fused tensor of layer il (key: a FUSED key; + BLOCKS / SCALES for MXFP4's)
        if (il, key) not in self._cache:
            self._cache = {k: v for k, v in self._cache.items() if k[0] == il}  # one layer at a time
            base = key.removesuffix(BLOCKS).removesuffix(SCALES)
            self._cache[(il, key)] = self.ckpt.read(FUSED[base].format(il=il) + key[len(base):])
        return self._cache[(il, key)]

    def _quantized(self, which: str) -> bool:
        return self.mxfp4 and which in ("gate", "up", "down")

    def entry(self, name: str):
        if name not in self.virtual:
            return self.ckpt.entry(name)
        il, _, which = self.virtual[name]
        I, D = self.model.args.intermediate_size, self.model.args.hidden_size
        shape = {"gate": (I, D), "up": (I, D), "down": (D, I), "gate_b": (I,), "up_b": (I,), "down_b": (D,)}[which]
        fused = FUSED[PIECE_OF[which]].format(il=il) + (BLOCKS if self._quantized(which) else "")
        return replace(self.ckpt.entry(fused), shape=shape)

    def expect(self, name: str, shape: tuple, integer: bool = False):
        if name not in self.virtual:
            return self.ckpt.expect(name, shape, integer)
        il, _, which = self.virtual[name]
        a = self.model.args
        E, D, I = self.model.n_expert, a.hidden_size, a.intermediate_size
        key = PIECE_OF[which]
        if self._quantized(which):  # MXFP4 blocks and scales, [out, in]
            mxfp4_pair(self.ckpt, FUSED[key].format(il=il), (E, 2 * I, D) if key == "gate_up" else (E, D, I))
            return self.entry(name)
        fused_shape = {"gate_up": (E, D, 2 * I), "down": (E, I, D), "gate_up_bias": (E, 2 * I),
                       "down_bias": (E, D)}[key]
        self.ckpt.expect(FUSED[key].format(il=il), fused_shape)
        return self.entry(name)

    def read_weight(self, name: str):
        # an expert's matrix as the engine computes on it: MXFP4 as a QuantWeight of its codes
        # and scales (an expert's rows of the fused blocks, exact), else as read
        if name not in self.virtual or not self._quantized(self.virtual[name][2]):
            return self.ckpt.read_weight(name) if name not in self.virtual else self.read(name)
        il, ie, which = self.virtual[name]
        key = PIECE_OF[which]
        blocks, scales = self._fused(il, key + BLOCKS)[ie], self._fused(il, key + SCALES)[ie]  # [N', G, 16], [N', G]
        rows = slice(0 if which == "gate" else 1, None, 2) if key == "gate_up" else slice(None)
        q = np.ascontiguousarray(blocks[rows].reshape(-1, blocks.shape[1] * 16))  # [N, K/2]
        return QuantWeight("mxfp4", q, np.ascontiguousarray(scales[rows]), mxfp4.GROUP)

    def read(self, name: str) -> np.ndarray:
        if name not in self.virtual:
            return self.ckpt.read(name)
        il, ie, which = self.virtual[name]
        if self._quantized(which):  # MXFP4: the float32 values (exact); read_weight keeps the codes
            return to_f32(self.read_weight(name))
        if which in ("gate", "up"):  # [D, 2I] columns gate, up, gate, up, ... -> [I, D]
            return np.ascontiguousarray(self._fused(il, "gate_up")[ie][:, 0 if which == "gate" else 1 :: 2].T)
        if which == "down":  # [I, D] -> [D, I]
            return np.ascontiguousarray(self._fused(il, "down")[ie].T)
        if which in ("gate_b", "up_b"):
            return np.ascontiguousarray(self._fused(il, "gate_up_bias")[ie][0 if which == "gate_b" else 1 :: 2])
        return np.ascontiguousarray(self._fused(il, "down_bias")[ie])


class Model(MoEModel):
    MODEL_TYPE = MODEL_TYPE
    NAMES = NAMES
    ROPE_DEFAULTS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
    EXPERT_KEYS = MoEModel.EXPERT_KEYS + ("expert_gate_bias", "expert_up_bias", "expert_down_bias")
    F32_KEYS = MoEModel.F32_KEYS | {"router_bias"}

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        self.attn_spec = AttnSpec(args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                                  args.rms_norm_eps)
        self.n_expert = args.num_local_experts
        self.windows = [args.sliding_window if t == "sliding_attention" else 0 for t in args.layer_types]
        super().__init__(args, config, where)

    def source(self, checkpoint):
        if hasattr(checkpoint, "name_all"):  # a GGUF file: its experts' gate and up already apart, each a slice
            return super().source(checkpoint)
        return FusedExperts(checkpoint, self)

    def shapes(self):
        a = self.args
        D, I, E = a.hidden_size, a.intermediate_size, a.num_local_experts

        def per_layer(il):
            return self.attn_shapes(a.attention_bias, a.attention_bias) | {
                "sinks": (a.num_attention_heads,), "router": (E, D), "router_bias": (E,)}

        experts = self.expert_shapes(I) | {"expert_gate_bias": (I,), "expert_up_bias": (I,), "expert_down_bias": (D,)}
        return self.global_shapes(), per_layer, experts

    def router(self, il, x):
        # x [T, D] -> ids, weights [T, A]
        L = self.layers[il]
        return route(linear(x, L["router"], L["router_bias"]), self.args.num_experts_per_tok)

    def block(self, il, h, step):
        # h [T, D] residual stream
        a, L = self.args, self.layers[il]
        h = h + attention(self.attn_spec, L, rmsnorm(h, L["in_norm"], a.rms_norm_eps), step, il, self.windows[il])
        x = rmsnorm(h, L["post_norm"], a.rms_norm_eps)
        ids, w = self.router(il, x)  # [T, A]
        return h + moe(x, ids, w, self.experts, il, step, ffn=partial(expert, a.swiglu_alpha, a.swiglu_limit),
                       clamped=(np.float32(a.swiglu_alpha), np.float32(a.swiglu_limit)))


def expert(alpha: float, limit: float, x, w):
    # x [n, D], one expert's (gate, up, down, gate_bias, up_bias, down_bias) -> [n, D]: the
    # biased, clamped SwiGLU (a module function, so an expert box on Ray gets it by name)
    gate, up, down, gb, ub, db = w
    g = np.minimum(linear(x, gate, to_f32(gb)), np.float32(limit))  # [n, I]
    u = np.clip(linear(x, up, to_f32(ub)), -limit, limit)  # [n, I]
    h = (u + 1) * (g / (1 + np.exp(-g * np.float32(alpha))))  # [n, I]
    return linear(h.astype(np.float32), down, to_f32(db))

