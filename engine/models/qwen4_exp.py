"""Qwen3.8-Flash-Next, published as Qwen4-Exp (`qwen4_exp`, its text model `qwen4_exp_text`):
Qwen3.5's hybrid layers (qwen3_5_moe.py: Gated DeltaNet, gated attention, the softmax router
with a gated shared expert) in a residual of `hc_count` streams, with a sparse-attention
indexer on the attention layers and per-layer n-gram embeddings.

- The residual: a token's state is [hc_count x D]. Before each half of a layer a gated
  residual (`hc_lowrank`) norms the streams (each its own RMSNorm group), mixes them into the
  half's input with per-channel sigmoid weights from a low-rank projection, and the half's
  output is added back into every stream times 2 sigmoid(an injection weight per stream).
  The final mixer makes the head's input the same way (no other final norm).
- QSA (`indexer_*`): an attention layer's query sees, of its visible tokens, the
  `indexer_budget / indexer_compress_ratio` best complete blocks of `indexer_compress_ratio`
  tokens, and the tokens after the last complete block. A block's key is the mean of its
  tokens' raw indexer keys, RMS-normed, rotated at the block's first position; its score the
  sum over the indexer's query heads of relu(q . key) / sqrt(d).
- PLE (`ple_layer_ids`): before such a layer, each token's hashed n-grams (orders 2 to
  `ngram_size`, `heads_per_ngram` hashes each, never across an end-of-sequence token) pick
  rows of the layer's n-gram embedding table; their projections gate a value per stream by
  the streams' agreement with a key, added to the streams with a dilated short convolution
  of it. In the published model the table is tens of billions of parameters, of which a
  token reads `(ngram_size - 1) x heads_per_ngram` rows a layer (ngram_rows()).

A sequence keeps the linear layers' states, the attention layers' keys and values and each
indexer's raw keys per token, the PLE convolutions' last inputs and the last
`ngram_size - 1` token ids. The checkpoint stores each table in `split_ngram_parts` shards
(ShardedTables shows them as one)."""

import math
from dataclasses import dataclass, replace

import numba as nb
import numpy as np

from .. import kernels
from ..attention import chosen_attention
from ..jit import JIT, family_warm
from ..layers import embed_rows, linear, rmsnorm, swiglu
from ..model import MoEModel, require, text_config, wrapped_names
from ..moe import moe
from ..recurrent import sigmoid
from . import qwen3_5_moe

MODEL_TYPE = "qwen4_exp"
ALIASES = qwen3_5_moe.ALIASES
INDEXED = "indexed_attention"


@dataclass
class ModelArgs(qwen3_5_moe.ModelArgs):
    num_experts: int = 512
    num_experts_per_tok: int = 10
    head_dim: int = 256
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: list | None = None
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    output_gate_type: str | None = None
    eos_token_id: int | list | None = None

    def __post_init__(self):
        # transformers' indexed_attention layers are Qwen3.5's full ones with QSA: colibri's
        # hybrid code knows them as full_attention
        if self.layer_types is not None:
            self.layer_types = ["full_attention" if t == INDEXED else t for t in self.layer_types]
        super().__post_init__()
        self.ple_layer_ids = sorted(set(self.ple_layer_ids or []))
        self.ple_embed_dim = self.ple_embed_dim or self.hidden_size
        eos = self.eos_token_id
        self.eos = eos[0] if isinstance(eos, list) and eos else eos
        require((self.output_gate_type or self.hidden_act) in ("sigmoid", "silu"), "output_gate_type must be sigmoid or silu")
        require(self.hc_count > 1, "hc_count must be more than 1")
        require(all(1 <= i <= self.num_hidden_layers for i in self.ple_layer_ids),
                "ple_layer_ids are 1-indexed layers")
        heads = (self.ngram_size - 1) * self.heads_per_ngram
        require(not self.ple_layer_ids or (heads > 0 and self.ple_embed_dim % heads == 0 and self.eos is not None),
                "PLE needs ngram_size >= 2, ple_embed_dim a multiple of the n-gram heads and an eos_token_id")
        if "full_attention" in self.layer_types:
            qsa = (self.indexer_n_heads, self.indexer_kv_heads, self.indexer_head_dim, self.indexer_budget,
                   self.indexer_compress_ratio)
            require(all(v is not None and v > 0 for v in qsa), "attention layers need the QSA indexer_* fields")
            require(self.indexer_kv_heads == 1 and self.indexer_budget % self.indexer_compress_ratio == 0,
                    "QSA needs indexer_kv_heads 1 and indexer_budget a multiple of indexer_compress_ratio")


L_ = "model.layers.{il}."
HC = {"attn": L_ + "attn_hyper_connection.", "mlp": L_ + "mlp_hyper_connection."}
PLE = L_ + "ple."
TABLE = PLE + "ple_embedding.ngram_embedding.weight"  # (stored as shard_{i}.weight: ShardedTables)
TEXT = {k: v for k, v in qwen3_5_moe.NAMES.items() if k not in ("in_norm", "post_norm", "norm")} | {
    **{f"hc_{h}_{p}": HC[h] + n for h in HC for p, n in (("norm", "hc_norm.weight"),
                                                        ("down", "input_mix_weight_down.weight"),
                                                        ("up", "input_mix_weight_up.weight"),
                                                        ("inject", "block_inject_weight.weight"))},
    "mix_norm": "model.hyper_connection_mixer.hc_norm.weight",
    "mix_down": "model.hyper_connection_mixer.input_mix_weight_down.weight",
    "mix_up": "model.hyper_connection_mixer.input_mix_weight_up.weight",
    "ix_qk": L_ + "self_attn.indexer.index_qk_proj.weight",
    "ix_q_norm": L_ + "self_attn.indexer.q_layernorm.weight",
    "ix_k_norm": L_ + "self_attn.indexer.k_layernorm.weight",
    "ple_table": TABLE, "ple_key": PLE + "key_proj.weight", "ple_value": PLE + "value_proj.weight",
    "ple_norm_key": PLE + "norm_key.weight", "ple_norm_query": PLE + "norm_query.weight",
    "ple_norm_conv": PLE + "norm_conv.weight", "ple_conv": PLE + "conv1d.weight",
}
ONE_PLUS = ("q_norm", "k_norm", "hc_attn_norm", "hc_mlp_norm", "ix_q_norm", "ix_k_norm", "ple_norm_key",
            "ple_norm_query", "ple_norm_conv")  # the norms that scale by (1 + w)


def splitmix64(value: int) -> int:
    m = (1 << 64) - 1
    value = (value + 0x9E3779B97F4A7C15) & m
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & m
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & m
    return (value ^ (value >> 31)) & m


def is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def primes_after(start: int, count: int) -> list[int]:
    """The first `count` primes above `start` (the n-gram heads' table sizes)."""
    out, p = [], start
    while len(out) < count:
        p += 1
        if is_prime(p):
            out.append(p)
    return out


class NGramHash:
    """The n-gram ids of one PLE layer (the `ple_index`-th), as transformers hashes them: per
    order g, token (t - s) times an odd multiplier XOR'd over s < g, modulo a prime per head
    (the (i+1)-th prime from ngram_vocab_size_base on, i the head's index over all PLE
    layers), plus the head's offset in the layer's table."""

    def __init__(self, a: ModelArgs, ple_index: int, primes: list[int] | None = None):
        # primes: the first primes after the base for every PLE layer's heads in turn (found
        # once for all layers: primes_after), else found here up to this layer's
        self.n, self.per = a.ngram_size, a.heads_per_ngram
        heads = (self.n - 1) * self.per
        primes = primes or primes_after(a.ngram_vocab_size_base - 1, (ple_index + 1) * heads)
        self.sizes = np.array(primes[ple_index * heads : (ple_index + 1) * heads], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.rows = -(-int(self.sizes.sum()) // a.make_ngram_vocab_size_divisible_by) * a.make_ngram_vocab_size_divisible_by
        half = max(1, ((1 << 63) - 1) // max(a.vocab_size, 1) // 2)
        base = a.seed + 10007 * ple_index
        self.mult = np.array([2 * (splitmix64((base + 0x9E3779B97F4A7C15 * (i + 1)) & ((1 << 64) - 1)) % half) + 1
                              for i in range(self.n)], np.int64)

    def ids(self, history: np.ndarray, eos: int, n: int) -> np.ndarray:
        # history [c + n] int64 (the context, then the step's tokens) -> the table rows [n, heads]
        # of the last n tokens; a token's n-gram stops at the last end-of-sequence before it
        L = len(history)
        pos = np.arange(L)
        last_eos = np.maximum.accumulate(np.where(history == eos, pos, -1))
        before = np.concatenate([[-1], last_eos[:-1]])  # the last eos strictly before each position
        shifted = [np.where((pos - s >= 0) & (pos - s > before), history[np.maximum(pos - s, 0)], eos)
                   for s in range(self.n)]
        with np.errstate(over="ignore"):
            products = [shifted[s] * self.mult[s] for s in range(self.n)]  # (int64, wrapping as torch's)
        out = []
        for g in range(2, self.n + 1):
            mixed = products[0]
            for s in range(1, g):
                mixed = np.bitwise_xor(mixed, products[s])
            h = slice((g - 2) * self.per, (g - 1) * self.per)
            out.append(np.mod(mixed[:, None], self.sizes[None, h]) + self.offsets[None, h])
        return np.concatenate(out, axis=1)[L - n :]  # [n, heads]


class ShardedTables:
    """A checkpoint whose PLE tables are stored in shards (`...ngram_embedding.shard_{i}.weight`,
    split along the rows) shown as one table each (`...ngram_embedding.weight`); everything
    else is the checkpoint's."""

    def __init__(self, checkpoint, tables: dict[str, int]):
        self.ckpt, self.parts = checkpoint, {}
        for name in tables:
            stem = name.removesuffix(".weight")
            parts = []
            while checkpoint.has(f"{stem}.shard_{len(parts)}.weight"):
                parts.append(f"{stem}.shard_{len(parts)}.weight")
            if parts:
                self.parts[name] = parts

    def __getattr__(self, name):
        return getattr(self.ckpt, name)

    @property
    def where(self) -> dict:
        # the checkpoint's names with each table's (what convert walks), in its first shard's file
        return self.ckpt.where | {name: self.ckpt.where[parts[0]] for name, parts in self.parts.items()}

    def has(self, name: str) -> bool:
        return name in self.parts or self.ckpt.has(name)

    def entry(self, name: str):
        if name not in self.parts:
            return self.ckpt.entry(name)
        es = [self.ckpt.entry(p) for p in self.parts[name]]
        return replace(es[0], name=name, shape=(sum(e.shape[0] for e in es), *es[0].shape[1:]))

    def expect(self, name: str, shape: tuple, integer: bool = False):
        if name not in self.parts:
            return self.ckpt.expect(name, shape, integer)
        for p in self.parts[name]:
            self.ckpt.expect(p, (self.ckpt.entry(p).shape[0], *shape[1:]))
        e = self.entry(name)
        if tuple(e.shape) != tuple(shape):
            from ...storage.errors import TensorShapeMismatch
            raise TensorShapeMismatch(f"{self.ckpt.file_of(self.parts[name][0])}: the shards of {name!r} hold "
                                      f"{e.shape[0]} rows; the config implies {shape[0]}")
        return e

    def read(self, name: str):
        if name not in self.parts:
            return self.ckpt.read(name)
        return np.concatenate([self.ckpt.read(p) for p in self.parts[name]])

    def read_weight(self, name: str):
        return self.read(name) if name in self.parts else self.ckpt.read_weight(name)

    def file_of(self, name: str) -> str:
        return self.ckpt.file_of(self.parts[name][0] if name in self.parts else name)


def group_rmsnorm(x: np.ndarray, w: np.ndarray, groups: int, eps: float) -> np.ndarray:
    # x [T, G D] -> each group of D RMS-normed, times w [G D] (the (1 + w) taken at load)
    T = x.shape[0]
    g = x.reshape(T, groups, -1)
    out = g * (np.float32(1) / np.sqrt(np.mean(np.square(g), -1, keepdims=True, dtype=np.float32) + np.float32(eps)))
    return (out.reshape(T, -1) * w).astype(np.float32)


@nb.njit(**JIT)
def block_scores(q, keys, scale, out):
    # q [n, H, d] indexer queries, keys [M, d] block keys -> out [n, M]: sum over heads of
    # relu(q . key) x scale, each row alone
    n, H, d = q.shape
    for t in range(n):
        for m in range(keys.shape[0]):
            total = np.float32(0.0)
            for h in range(H):
                acc = np.float32(0.0)
                for j in range(d):
                    acc += q[t, h, j] * keys[m, j]
                total += max(acc, np.float32(0.0))
            out[t, m] = total * scale


@family_warm("qwen4_exp")
def warm() -> None:
    # block_scores on tiny C arrays, as QSA's indexer calls it
    block_scores(np.ones((2, 2, 4), np.float32), np.ones((3, 4), np.float32), np.float32(0.5),
                 np.empty((2, 3), np.float32))


class Model(qwen3_5_moe.Model):
    MODEL_TYPE = MODEL_TYPE
    KERNEL_GROUPS = ("recurrent", "chosen", "qwen4_exp")  # (jit.family_warm: kernels of its own, compiled before its first step)
    ATTENTION = "hybrid: Gated DeltaNet + GQA with QSA, hyper-connections, n-gram embeddings"
    F32_KEYS = qwen3_5_moe.Model.F32_KEYS | set(ONE_PLUS) | {"mix_norm", "ple_conv"}
    # beside Qwen3.5's: the hyper-connection mixers, the per-layer embeddings' projections and the QSA indexer's
    INT_DENSE_KEYS = qwen3_5_moe.Model.INT_DENSE_KEYS + ("hc_attn_down", "hc_attn_up", "hc_attn_inject",
                                                         "hc_mlp_down", "hc_mlp_up", "hc_mlp_inject", "ple_key",
                                                         "ple_value", "ix_qk")
    ROPE_DEFAULTS = {"rope_theta": 10000.0, "rope_type": "default"}  # (the whole head rotates unless it says)
    TABLE_KEYS = frozenset({"ple_table"})  # streamable by rows from a container (storage/tables.py)

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        wrapped = text_config(config) is not config
        super().__init__(args, config, where)
        self.NAMES = wrapped_names(TEXT, {"model.": qwen3_5_moe.LANGUAGE_MODEL}) if wrapped else TEXT
        self.ple_rows = {i - 1: k for k, i in enumerate(args.ple_layer_ids)}  # layer -> its PLE row
        heads = (args.ngram_size - 1) * args.heads_per_ngram
        primes = primes_after(args.ngram_vocab_size_base - 1, len(self.ple_rows) * heads)  # (once, for every layer)
        self.hashes = {il: NGramHash(args, k, primes) for il, k in self.ple_rows.items()}

    def source(self, checkpoint):
        self.spell(checkpoint)
        return ShardedTables(checkpoint, {self.NAMES["ple_table"].format(il=il): il for il in self.ple_rows})

    def global_shapes(self) -> dict:
        a = self.args
        D, nD = a.hidden_size, a.hc_count * a.hidden_size
        glob = {"embed": (a.vocab_size, D), "mix_norm": (nD,), "mix_down": (a.hc_lowrank, nD),
                "mix_up": (nD, a.hc_lowrank)}
        return glob | ({} if a.tie_word_embeddings else {"lm_head": (a.vocab_size, D)})

    def shapes(self):
        a = self.args
        glob, per_layer, expert = super().shapes()
        n, D = a.hc_count, a.hidden_size
        nD, r = n * D, a.hc_lowrank

        def layer(il):
            s = {k: v for k, v in per_layer(il).items() if k not in ("in_norm", "post_norm")}
            for h in ("attn", "mlp"):
                s |= {f"hc_{h}_norm": (nD,), f"hc_{h}_down": (r, nD), f"hc_{h}_up": (nD, r), f"hc_{h}_inject": (n, nD)}
            if a.layer_types[il] == "full_attention":
                s |= {"ix_qk": ((a.indexer_n_heads + 1) * a.indexer_head_dim, D),
                      "ix_q_norm": (a.indexer_head_dim,), "ix_k_norm": (a.indexer_head_dim,)}
            if il in self.ple_rows:
                E = a.ple_embed_dim
                s |= {"ple_table": (self.hashes[il].rows, E // ((a.ngram_size - 1) * a.heads_per_ngram)),
                      "ple_key": (nD, E), "ple_value": (D, E), "ple_norm_key": (nD,), "ple_norm_query": (nD,),
                      "ple_norm_conv": (nD,), "ple_conv": (nD, 1, a.ple_conv_kernel_size)}
            return s

        return glob, layer, expert

    def load(self, *args, **kwargs):
        MoEModel.load(self, *args, **kwargs)  # (not qwen3_next's: its final `norm` Qwen4-Exp has none of)
        one = np.float32(1.0)
        self.glob["mix_norm"] = self.glob["mix_norm"] + one
        for L in self.layers:
            for key in ONE_PLUS:
                if key in L:
                    L[key] = L[key] + one
            for key in ("conv", "ple_conv"):
                if key in L:
                    L[key] = np.ascontiguousarray(L[key].reshape(L[key].shape[0], -1))  # [C, K]
        return self

    def kv_layout(self):
        shapes, views, flat = super().kv_layout()
        if self.n_full:  # each indexer's raw key per token (saved without a heads axis)
            shapes |= {"ik": (self.n_full, 1, self.args.indexer_head_dim)}
        return shapes, views, flat | {"ik"}

    def state_layout(self) -> dict[str, tuple]:
        a = self.args
        out = super().state_layout()
        if self.ple_rows:  # the PLE convolutions' last inputs, the last ngram_size - 1 token ids (+ 1; 0: none yet)
            out |= {"ple_conv": (len(self.ple_rows), (a.ple_conv_kernel_size - 1) * a.ngram_size, a.hc_count * a.hidden_size),
                    "ngram_ctx": (1, 1, a.ngram_size - 1)}
        return out

    # ---- the residual streams: [T, hc_count x D] ----
    def embed(self, ids):
        self.step_ids = np.asarray(ids, np.int64)  # (the PLE layers hash them)
        self.step_rows = {}  # PLE layer -> its table rows for the step [T, heads], hashed when first asked
        h = super().embed(ids)
        return np.ascontiguousarray(np.tile(h, (1, self.args.hc_count)))

    def begin_layers(self, step) -> None:
        # the step's token ids are known: every PLE layer's rows hashed now, and a streamed
        # table's pages asked for, read while the layers before it compute
        for il in self.ple_rows:
            self.step_rows[il] = self.ngram_rows(il, step)
            table = self.layers[il]["ple_table"]
            if hasattr(table, "prefetch"):
                table.prefetch(self.step_rows[il])
        if self.ple_rows:
            self.end_step(step)

    def mix(self, h, norm, down, up, inject=None):
        # h [T, n D] streams -> the mixed input [T, D] (and the injection weights [T, n])
        a = self.args
        n, T = a.hc_count, h.shape[0]
        hn = group_rmsnorm(h, norm, n, a.rms_norm_eps)
        m = linear(hn, down) / np.float32(n)
        m = sigmoid(linear((m * sigmoid(m)).astype(np.float32), up))  # [T, n D]
        mixed = (m.reshape(T, n, -1) * hn.reshape(T, n, -1)).mean(1, dtype=np.float32)
        if inject is None:
            return mixed
        return mixed, np.float32(2) * sigmoid(linear(hn, inject) / np.float32(n))

    def head_input(self, h):
        g = self.glob
        return self.mix(h, g["mix_norm"], g["mix_down"], g["mix_up"])

    def final_norm(self, x):
        return x  # (the final mixer's output is the head's input as it is)

    def moe_input(self, il, h):
        # the lookahead's guess at layer il's MoE input: its mixer on the streams before the layer
        L = self.layers[il]
        return self.mix(h, L["hc_mlp_norm"], L["hc_mlp_down"], L["hc_mlp_up"])

    def block(self, il, h, step):
        a, L = self.args, self.layers[il]
        T = h.shape[0]
        if il in self.ple_rows:
            h = h + self.ple(il, h, step)
        x, w = self.mix(h, L["hc_attn_norm"], L["hc_attn_down"], L["hc_attn_up"], L["hc_attn_inject"])
        out = self.attention(il, x, step) if a.layer_types[il] == "full_attention" else \
            self.gated_delta_net(L, x, step, il)
        h = h + (out[:, None] * w[..., None]).reshape(T, -1)
        x, w = self.mix(h, L["hc_mlp_norm"], L["hc_mlp_down"], L["hc_mlp_up"], L["hc_mlp_inject"])
        ids, rw = self.router(il, x)
        shared = swiglu(x, L["shared_gate_proj"], L["shared_up"], L["shared_down"])
        out = moe(x, ids, rw, self.experts, il, step) + sigmoid(linear(x, L["shared_gate"])) * shared
        return (h + (out[:, None] * w[..., None]).reshape(T, -1)).astype(np.float32)

    def output_gate(self, z):
        return sigmoid(z) if (self.args.output_gate_type or self.args.hidden_act) == "sigmoid" else z * sigmoid(z)

    # ---- PLE ----
    def ngram_rows(self, il: int, step) -> np.ndarray:
        # the step's tokens -> their rows of layer il's table [T, heads]; each sequence's last
        # ngram_size - 1 ids go on in its state (stored + 1: 0 is none yet, an end of sequence)
        a, out = self.args, []
        for sg in step.segments:
            ctx = sg.cache.state["ngram_ctx"][0, 0]
            ids = self.step_ids[sg.start : sg.start + sg.n]
            history = np.concatenate([np.where(ctx > 0, ctx.astype(np.int64) - 1, a.eos), ids])
            out.append(self.hashes[il].ids(history, a.eos, sg.n))
        return np.concatenate(out)

    def end_step(self, step) -> None:
        # after the last PLE layer: each sequence's context moves on by its tokens
        for sg in step.segments:
            ctx = sg.cache.state["ngram_ctx"][0, 0]
            c = len(ctx)
            ids = self.step_ids[sg.start : sg.start + sg.n].astype(np.float32) + 1
            ctx[:] = np.concatenate([ctx, ids])[-c:]

    def ple(self, il, h, step):
        # h [T, n D] streams -> what the layer's n-gram embeddings add to them [T, n D]
        a, L = self.args, self.layers[il]
        n, D, T = a.hc_count, a.hidden_size, h.shape[0]
        table, rows = L["ple_table"], self.step_rows[il]
        emb = (table.rows(rows) if hasattr(table, "rows") else embed_rows(table, rows.reshape(-1))).reshape(T, -1)
        key = group_rmsnorm(linear(emb, L["ple_key"]), L["ple_norm_key"], n, a.rms_norm_eps).reshape(T, n, D)
        value = linear(emb, L["ple_value"])  # [T, D]
        query = group_rmsnorm(h, L["ple_norm_query"], n, a.rms_norm_eps).reshape(T, n, D)
        gate = (key * query).sum(-1, dtype=np.float32) / np.float32(math.sqrt(D))  # [T, n]
        gate = np.sqrt(np.maximum(np.abs(gate), np.float32(1e-6))) * np.sign(gate)
        gated = (sigmoid(gate.astype(np.float32))[..., None] * value[:, None]).reshape(T, -1)  # [T, n D]
        normed = group_rmsnorm(gated, L["ple_norm_conv"], n, a.rms_norm_eps)
        conv = np.empty_like(normed)
        taps, dil = L["ple_conv"], a.ngram_size  # [C, K], the dilation
        K = taps.shape[1]
        for sg in step.segments:
            rows = slice(sg.start, sg.start + sg.n)
            state = sg.cache.state["ple_conv"][self.ple_rows[il]]  # [(K - 1) dil, C]
            ext = np.concatenate([state, normed[rows]])
            acc = np.zeros((sg.n, ext.shape[1]), np.float32)
            for j in range(K):
                acc += taps[:, j] * ext[j * dil : j * dil + sg.n]
            conv[rows] = acc * sigmoid(acc)
            state[:] = ext[len(ext) - len(state):]
        return gated + conv

    # ---- attention with QSA ----
    def attention(self, il, x, step):
        # x [T, D] -> [T, D]: Qwen3.5's gated attention over the tokens the layer's indexer chose
        a, L, sp = self.args, self.layers[il], self.attn_spec
        T, H, Hkv, hd = x.shape[0], sp.n_head, sp.n_kv_head, sp.head_dim
        qg = linear(x, L["q"]).reshape(T, H, 2 * hd)
        q = np.ascontiguousarray(rmsnorm(qg[..., :hd], L["q_norm"], a.rms_norm_eps))
        gate = qg[..., hd:].reshape(T, H * hd)
        k = np.ascontiguousarray(rmsnorm(linear(x, L["k"]).reshape(T, Hkv, hd), L["k_norm"], a.rms_norm_eps))
        v = linear(x, L["v"]).reshape(T, Hkv, hd)
        kernels.rope(q, step.cos, step.sin)
        kernels.rope(k, step.cos, step.sin)
        chosen = self.choose(il, x, step)
        s, out = self.slot[il], np.empty((T, H, hd), np.float32)
        for sg, allowed in zip(step.segments, chosen):
            rows, cache, pos0 = slice(sg.start, sg.start + sg.n), sg.cache, sg.cache.n_pos
            cache.write("k", s, pos0, k[rows])
            cache.write("v", s, pos0, v[rows])
            S = pos0 + sg.n
            keys, vals = (np.ascontiguousarray(np.stack([cache.gather(nm, s, g, S) for g in range(Hkv)], 1))
                          for nm in ("k", "v"))
            chosen_attention(np.ascontiguousarray(q[rows]), keys, vals, allowed, np.float32(hd**-0.5), out[rows])
        return linear(out.reshape(T, H * hd) * sigmoid(gate), L["o"])

    def choose(self, il, x, step) -> list:
        # per sequence, allowed [n, S]: each query's tokens of its best complete blocks and after them
        a, L = self.args, self.layers[il]
        T, Hi, dI, r = x.shape[0], a.indexer_n_heads, a.indexer_head_dim, a.indexer_compress_ratio
        qk = linear(x, L["ix_qk"])
        q = np.ascontiguousarray(rmsnorm(qk[:, : Hi * dI].reshape(T, Hi, dI), L["ix_q_norm"], a.rms_norm_eps))
        kernels.rope(q, step.cos, step.sin)
        raw = qk[:, Hi * dI :]  # [T, dI]
        out, s = [], self.slot[il]
        for sg in step.segments:
            rows, cache, pos0 = slice(sg.start, sg.start + sg.n), sg.cache, sg.cache.n_pos
            cache.write("ik", s, pos0, raw[rows, None])
            S = pos0 + sg.n
            M = S // r
            keys = np.zeros((M, 1, dI), np.float32)
            if M:
                keys[:, 0] = rmsnorm(cache.gather("ik", s, 0, M * r).reshape(M, r, dI).mean(1, dtype=np.float32),
                                     L["ix_k_norm"], a.rms_norm_eps)
                cos, sin = self.rope.at(np.arange(M) * r)
                kernels.rope(keys, cos, sin)
            scores = np.empty((sg.n, M), np.float32)
            block_scores(q[rows], np.ascontiguousarray(keys[:, 0]), np.float32(dI**-0.5), scores)
            pos = pos0 + np.arange(sg.n)
            seen = (np.arange(M)[None, :] + 1) * r - 1 <= pos[:, None]  # [n, M]
            top = np.argsort(-np.where(seen, scores, -np.inf), axis=-1, kind="stable")[:, : a.indexer_budget // r]
            picked = np.zeros((sg.n, M), bool)
            np.put_along_axis(picked, top, True, axis=-1)
            allowed = np.concatenate([np.repeat(picked & seen, r, axis=1), np.zeros((sg.n, S - M * r), bool)], axis=1)
            tok = np.arange(S)[None, :]
            allowed |= (tok >= (pos[:, None] + 1) // r * r) & (tok <= pos[:, None])  # the tail after the last block
            out.append(allowed)
        return out
