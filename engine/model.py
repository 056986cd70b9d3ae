"""What every family shares: config parsing into ModelArgs, the checked weight
loading from a declarative name map, and the forward pass around the family's block.

A family file defines `ModelArgs` (Hugging Face field names), `NAMES` (our key ->
checkpoint tensor name template), `route()` and a `Model(MoEModel)` that says which
tensors each layer has (`shapes`) and writes out one decoder layer (`block`).
"""

import dataclasses
import functools
import time
import types
import typing

import numpy as np

from ..storage.errors import ConfigInvalid
from ..storage.experts import ExpertSource, QuantWeight, ResidentExperts
from .crew import crew_session
from .errors import ActivationsUnsupported
from .formats import intdot
from .formats.intdot import TILE
from .layers import embed_rows, linear, rmsnorm, to_f32
from .rope import Rope, rope_inv_freq, rope_parameters
from .sequence import KVCache, KVPool, Segment, Step

ACTIVATIONS = ("float32", "int8")  # what the routed experts may compute on (MoEModel.set_activations)
DTYPE_NAMES = {np.dtype(np.uint16).str: "bf16", np.dtype(np.float16).str: "f16", np.dtype(np.float32).str: "f32"}


# our weight key -> checkpoint tensor name, as Llama-descended families spell them
HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "in_norm": "model.layers.{il}.input_layernorm.weight",
    "post_norm": "model.layers.{il}.post_attention_layernorm.weight",
    "q": "model.layers.{il}.self_attn.q_proj.weight",
    "k": "model.layers.{il}.self_attn.k_proj.weight",
    "v": "model.layers.{il}.self_attn.v_proj.weight",
    "o": "model.layers.{il}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{il}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{il}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{il}.self_attn.v_proj.bias",
    "o_bias": "model.layers.{il}.self_attn.o_proj.bias",
    "q_norm": "model.layers.{il}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{il}.self_attn.k_norm.weight",
    "router": "model.layers.{il}.mlp.gate.weight",
    "gate": "model.layers.{il}.mlp.gate_proj.weight",
    "up": "model.layers.{il}.mlp.up_proj.weight",
    "down": "model.layers.{il}.mlp.down_proj.weight",
    "expert_gate": "model.layers.{il}.mlp.experts.{ie}.gate_proj.weight",
    "expert_up": "model.layers.{il}.mlp.experts.{ie}.up_proj.weight",
    "expert_down": "model.layers.{il}.mlp.experts.{ie}.down_proj.weight",
}


def _type_ok(value, tp) -> bool:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return any(_type_ok(value, t) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin = typing.get_origin(tp) or tp
    return isinstance(value, origin)


def parse_args(cls, cfg: dict, aliases: dict[str, tuple[str, ...]] | None = None, where: str = "config.json"):
    """Build the dataclass `cls` from a config dict: fields by Hugging Face name (or an
    alias spelling), defaults where absent, unknown keys ignored.

    Raises ConfigInvalid naming the field for a missing required field or a wrong type.
    """
    aliases = aliases or {}
    kw = {}
    for f in dataclasses.fields(cls):
        for key in (f.name, *aliases.get(f.name, ())):
            if key in cfg:
                value = cfg[key]
                if not _type_ok(value, f.type):
                    raise ConfigInvalid(f"{where}: {key} = {value!r} is not of type {f.type}")
                kw[f.name] = float(value) if f.type is float else value
                break
        else:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigInvalid(f"{where}: required field {f.name} is missing")
    try:
        return cls(**kw)
    except ValueError as e:
        raise ConfigInvalid(f"{where}: {e}") from None


def text_config(cfg: dict) -> dict:
    """The text model's config of an image-text model (its `text_config`), else the config
    itself. A family whose module has this function is one the registry reads this way."""
    inner = cfg.get("text_config")
    return inner if isinstance(inner, dict) else cfg


def wrapped_names(names: dict[str, str], prefixes: dict[str, str], head: str = "lm_head.weight") -> dict[str, str]:
    """A text model's NAMES in an image-text checkpoint: each name's first matching prefix
    of `prefixes` replaced by what it maps to (`model.` -> `model.language_model.`), the
    output head named `head`."""
    def spelled(name: str) -> str:
        old = next((p for p in prefixes if name.startswith(p)), None)
        return name if old is None else prefixes[old] + name[len(old):]

    return {k: head if k == "lm_head" else spelled(v) for k, v in names.items()}


def require(cond: bool, message: str) -> None:
    """For ModelArgs.__post_init__ checks: raise ValueError(message) unless cond
    (parse_args turns it into ConfigInvalid)."""
    if not cond:
        raise ValueError(message)


def check_moe_args(a, n_expert: int) -> None:
    """The checks every family's ModelArgs makes (raise ValueError, see require)."""
    require(a.hidden_act == "silu", f"hidden_act {a.hidden_act!r} is not supported (silu)")
    require(a.num_attention_heads % a.num_key_value_heads == 0,
            "num_attention_heads must be a multiple of num_key_value_heads")
    require(0 < a.num_experts_per_tok <= n_expert, "num_experts_per_tok must be between 1 and the number of experts")
    require(getattr(a, "decoder_sparse_step", 1) > 0, "decoder_sparse_step must be positive")


class MoEModel:
    """A loaded model: dense weights resident, routed experts behind an ExpertSource."""

    NAMES: dict[str, str] = {}
    # RoPE of a config that sets none: its transformers config class's defaults
    ROPE_DEFAULTS = {"rope_theta": 10000.0, "rope_type": "default"}
    ATTENTION = "GQA"  # the attention kind, as doctor and run name it
    # whether a sampled token's cache row (computed alone in its step) is the same bits as
    # the row of the same token in a prompt: then the prefix cache keeps replies too
    DECODE_ROWS_EXACT = True
    EXPERT_KEYS = ("expert_gate", "expert_up", "expert_down")  # an expert's tensors, in the record's order
    # keys widened to float32 at load (small vectors and the routers); everything else keeps
    # the checkpoint's precision. A family with other small tensors names its own set.
    CREW_EXPERTS = True  # the routed experts are the crew's SwiGLU (or gpt-oss's clamped one): int8 activations take them
    INTEGER_KEYS: frozenset = frozenset()  # keys of integer tables (DeepSeek-V4's tid2eid), not weights
    TABLE_KEYS: frozenset = frozenset()  # per-layer tables a container may stream by rows (Qwen4-Exp's n-gram tables)
    F32_KEYS = frozenset({"norm", "in_norm", "post_norm", "q_norm", "k_norm", "q_bias", "k_bias", "v_bias",
                          "o_bias", "router", "shared_gate", "sinks"})

    def __init__(self, args, config: dict, where: str = "config.json"):
        """The model's structure from its args and config (no weights yet: see load).
        Raises ConfigInvalid for a RoPE type colibri does not implement."""
        self.args = args
        self.note = config.get("colibri_demo")  # what the built-in demo says of itself, shown to its users
        self.n_layer = args.num_hidden_layers
        self.head_dim = self.attn_spec.head_dim
        params = rope_parameters(config, self.ROPE_DEFAULTS)
        if params["rope_type"] not in ("default", "linear", "yarn"):
            raise ConfigInvalid(f"{where}: rope type {params['rope_type']!r} is not supported (default, linear, yarn)")
        self.rope = self.make_rope(params)
        self.n_ctx = args.max_position_embeddings
        self.moe_layers = [il for il in range(self.n_layer) if self.is_moe(il)]
        self.glob: dict[str, np.ndarray] = {}
        self.layers: list[dict[str, np.ndarray]] = []
        self.experts: ExpertSource | None = None
        self.source_precision: dict | None = None  # a container's precision, as its manifest says
        self.activations = "float32"  # or "int8": the experts' integer path, lossy (set_activations)
        self.beat = 0.0  # when the last layer finished (time.monotonic): progress a watchdog can see

    def expert_names(self, il: int, ie: int) -> tuple[str, ...]:
        """Checkpoint names of expert ie of layer il: (gate, up, down), then its biases when
        the family has them (EXPERT_KEYS)."""
        return tuple(self.NAMES[k].format(il=il, ie=ie) for k in self.EXPERT_KEYS)

    def source(self, checkpoint):
        """The checkpoint as this family reads it: itself, or a view (gpt-oss presents its
        fused expert tensors as one (gate, up, down, biases) per expert)."""
        self.spell(checkpoint)
        if hasattr(checkpoint, "name_all"):  # a GGUF file: its tensors under the names this family reads
            checkpoint.name_all(self.dense_names() + [n for il in self.moe_layers for ie in range(self.n_expert)
                                                      for n in self.expert_names(il, ie)])
        return checkpoint

    def spell(self, store) -> None:
        """Take NAMES in the spelling `store` (a checkpoint, a container's dense file) uses,
        where a family's checkpoints come in more than one (kimi_k25: the hub's and the one
        transformers writes). Called before the names are checked."""

    INT_DENSE_KEYS: tuple = ()  # per-layer matrices computed only by linear(): what --dense-dtype int8/int4 quantizes

    def int_dense_names(self) -> list[str]:
        """The checkpoint names of the dense matrices a container may keep in int8 or int4
        (INT_DENSE_KEYS of every layer, and an untied LM head): each goes through linear()
        alone, which computes on a QuantWeight as on an array."""
        if not self.INT_DENSE_KEYS:
            return []
        glob, per_layer, _ = self.shapes()
        names = [self.NAMES[k].format(il=il) for il in range(self.n_layer) for k in self.INT_DENSE_KEYS
                 if k in per_layer(il)]
        return names + ([self.NAMES["lm_head"]] if "lm_head" in glob and not self.args.tie_word_embeddings else [])

    def dense_names(self) -> list[str]:
        """The checkpoint names of every tensor the model reads but the routed experts (a
        converted container keeps these and nothing else: e.g. not DeepSeek's MTP layers)."""
        glob, per_layer, _ = self.shapes()
        return [self.NAMES[k] for k in glob] + [self.NAMES[k].format(il=il) for il in range(self.n_layer)
                                                 for k in per_layer(il)]

    def kv_bytes_per_token(self) -> int:
        """What one token's context takes in the family's KV cache, every layer (a view shares
        its bytes with the array it looks into)."""
        return sum(L * H * d * 4 for L, H, d in self.kv_layout()[0].values())

    def check(self, src, with_experts: bool = True) -> None:
        """Check that src (a Checkpoint, or a container's dense file) has every tensor the
        family needs with the shape the config implies, before any is read.
        Raises TensorMissing, TensorShapeMismatch or UnsupportedDtype."""
        glob, per_layer, per_expert = self.shapes()
        for key, shape in glob.items():
            src.expect(self.NAMES[key], shape, key in self.INTEGER_KEYS)
        for il in range(self.n_layer):
            for key, shape in per_layer(il).items():
                src.expect(self.NAMES[key].format(il=il), shape, key in self.INTEGER_KEYS)
        if with_experts:
            for il in self.moe_layers:
                for ie in range(self.n_expert):
                    for name, shape in zip(self.expert_names(il, ie), per_expert.values()):
                        src.expect(name, shape)

    def table_names(self) -> list[str]:
        """The checkpoint names of the tables (TABLE_KEYS) a container keeps streamable."""
        _, per_layer, _ = self.shapes()
        return [self.NAMES[k].format(il=il) for il in range(self.n_layer) for k in self.TABLE_KEYS if k in per_layer(il)]

    def load(self, src, experts: ExpertSource | None = None, progress=None, precision: dict | None = None,
             tables=None):
        """Read the dense weights from src (checked first: storage/placement.py does);
        routed experts come from `experts`, or, when None, are all read from src into RAM.
        `precision` is the container's, when the weights come from one. `tables` (a
        storage/tables.py TableCache), when given, streams the TABLE_KEYS tables by rows
        instead of reading them. `progress(phase, done, total)` hears each tensor read.
        Returns self. Raises what src.read raises."""
        self.source_precision = precision
        glob, per_layer, _ = self.shapes()
        total = len(glob) + sum(len(per_layer(il)) for il in range(self.n_layer))
        done = 0

        def read(key: str, name: str) -> np.ndarray:
            nonlocal done
            if progress:
                progress("reading dense weights", done, total)
            if tables is not None and key in self.TABLE_KEYS:
                done += 1
                return tables.table(name)  # (its rows read as steps take them)
            a = src.read_weight(name)  # an FP8 matrix as its codes and scales (a QuantWeight)
            done += 1
            return to_f32(a) if key in self.F32_KEYS else a

        self.glob = {key: read(key, self.NAMES[key]) for key in glob}
        self.layers = [
            {key: read(key, self.NAMES[key].format(il=il)) for key in per_layer(il)} for il in range(self.n_layer)
        ]
        self.lm_head = self.glob["embed"] if self.args.tie_word_embeddings else self.glob["lm_head"]
        self.experts = experts or ResidentExperts(src, self.moe_layers, self.n_expert, self.expert_names)
        self.tables = tables
        self.set_activations((precision or {}).get("activations", "float32"))
        return self

    def set_activations(self, name: str) -> None:
        """Compute the routed experts on float32 activations (exact: the default), or on
        activations quantised to int8 ("int8": formats/intdot.py, lossy, labelled in precision()
        and so on every output); the same for dense matrices a container keeps in int8 or int4.
        The integer kernels take the weights in tiles of 16 rows: the dense matrices are copied
        so, the expert source lays its experts out so in RAM (ExpertCache.arrange), and both back
        to rows for float32. int8 needs int8 or int4 experts (or such dense matrices) of whole
        tiles and blocks, computed by the crew: raises ActivationsUnsupported otherwise,
        ValueError for another name."""
        if name not in ACTIVATIONS:
            raise ValueError(f"activations {name!r}: not one of {', '.join(ACTIVATIONS)}")
        # (a flag, not a list of them: a list kept every matrix alive beside its arranged copy,
        # the dense int bytes twice over at the load's peak)
        dense = any(isinstance(w, QuantWeight) and w.kind in ("int8", "int4")
                    for L in [self.glob, *self.layers] for w in L.values())  # convert --dense-dtype int8/int4
        int_experts = self.expert_kind() in ("int8", "int4")
        if name == "int8" and not int_experts and not dense:
            raise ActivationsUnsupported(f"activations int8 needs int8 or int4 experts; these are "
                                         f"{self.expert_kind()} (colictl convert --dtype int4 or int8 makes them so)")
        g = (self.source_precision or {}).get("group_size")
        shapes = [shape for shape in self.shapes()[2].values() if len(shape) == 2]
        if name == "int8" and int_experts and any(n % TILE or c % 32 or (g or c) % 32 or c % (g or c)
                                                  for n, c in shapes):
            raise ActivationsUnsupported(f"activations int8 takes expert matrices of whole tiles of {TILE} rows and "
                                         f"blocks of 32 columns (and groups); these are "
                                         f"{sorted(set(shapes))} (group {g or 'a row'})")
        if name == "int8" and int_experts and not self.CREW_EXPERTS:
            raise ActivationsUnsupported(f"activations int8: {self.args.model_type}'s experts are not computed by "
                                         f"the integer kernels; convert with --activations float32")
        if not self.args.tie_word_embeddings and "lm_head" in self.glob:
            self.lm_head = None  # (re-pointed below: the old matrix freed as its copy is made)
        for L in [self.glob, *self.layers]:  # what linear() reads (engine/layers.py)
            for k in list(L):
                w = L[k]
                if isinstance(w, QuantWeight) and w.kind in ("int8", "int4") and w.integer != (name == "int8"):
                    L[k] = intdot.arranged(w, name == "int8")
                del w
        if not self.args.tie_word_embeddings and "lm_head" in self.glob:
            self.lm_head = self.glob["lm_head"]
        self.activations = name
        src = self.experts  # what moe() reads (engine/moe.py): the source and each one it wraps (the Ray boxes')
        while src is not None:
            src.activations = name if int_experts else "float32"
            if int_experts and hasattr(src, "arrange"):
                src.arrange(intdot.arrange_expert if name == "int8" else None)
            src = getattr(src, "__dict__", {}).get("inner")

    def expert_kind(self) -> str:
        """The routed experts' number format (bf16, int4, fp8_e4m3, ...)."""
        if self.source_precision is not None:
            return self.source_precision.get("experts") or "?"
        return self.precision()["experts"]

    def kernel_kinds(self) -> set:
        """The number formats this model computes in, {(kind, int4 group size or None)}: the
        kernels engine/layers.init compiles (loads) for it, no others."""
        dense = {(w.kind, w.group_size if w.kind == "int4" else None)
                 for L in [self.glob, *self.layers] for w in L.values() if isinstance(w, QuantWeight)}
        g = self.experts.int4_group
        kinds = dense | ({("int4", g)} if g else {(k, None) for k in self.expert_kind().split("+")})  # (GGUF: q4_k+q6_k)
        if self.activations == "int8":  # the integer path (engine/warm.py)
            kinds.add(("int8-activations", None))
        return kinds | {(f"family:{name}", None) for name in self.KERNEL_GROUPS}

    KERNEL_GROUPS: tuple = ()  # the family's own kernels' warm-ups (engine/warm.family_warm), compiled with its formats

    # ---- what a family defines ----
    attn_spec = None  # AttnSpec
    n_expert = 0

    def shapes(self):
        """(global {key: shape}, per_layer(il) -> {key: shape}, per_expert {key: shape})"""
        raise NotImplementedError

    def is_moe(self, il: int) -> bool:
        return True

    def make_rope(self, params: dict) -> Rope:
        """The rotary table of the attention heads (the first head_dim * partial_rotary_factor
        dims); a family whose rotary part has another size says so here."""
        return Rope(*rope_inv_freq(params, self.head_dim, self.args.max_position_embeddings))

    def router(self, il: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x [T, D], layer il's MoE input -> (expert ids [T, A], weights [T, A]) by the
        family's pure route(); the block and the lookahead both call it."""
        raise NotImplementedError

    def moe_input(self, il: int, h: np.ndarray) -> np.ndarray:
        # h [T, D] residual stream -> layer il's MoE input [T, D]: its pre-MoE norm
        return rmsnorm(h, self.layers[il]["post_norm"], self.args.rms_norm_eps)

    @property
    def n_expert_used(self) -> int:
        return self.args.num_experts_per_tok

    def block(self, il: int, h: np.ndarray, step: Step) -> np.ndarray:
        raise NotImplementedError

    # ---- shapes every family shares ----
    def global_shapes(self) -> dict:
        a = self.args
        glob = {"embed": (a.vocab_size, a.hidden_size), "norm": (a.hidden_size,)}
        if not a.tie_word_embeddings:
            glob["lm_head"] = (a.vocab_size, a.hidden_size)
        return glob

    def attn_shapes(self, qkv_bias: bool = False, o_bias: bool = False) -> dict:
        """Norms and attention projections of one layer (q/k norms as attn_spec says)."""
        D, sp = self.args.hidden_size, self.attn_spec
        q, kv = sp.n_head * sp.head_dim, sp.n_kv_head * sp.head_dim
        vo, kvv = sp.n_head * sp.hv, sp.n_kv_head * sp.hv  # value and output sizes (value heads may differ)
        s = {"in_norm": (D,), "post_norm": (D,), "q": (q * (2 if sp.output_gate else 1), D), "k": (kv, D),
             "v": (kvv, D), "o": (D, vo)}
        if sp.qk_norm == "head":
            s |= {"q_norm": (sp.head_dim,), "k_norm": (sp.head_dim,)}
        elif sp.qk_norm == "full":
            s |= {"q_norm": (q,), "k_norm": (kv,)}
        if qkv_bias:
            s |= {"q_bias": (q,), "k_bias": (kv,), "v_bias": (kvv,)}
        if o_bias:
            s |= {"o_bias": (D,)}
        return s

    def expert_shapes(self, n_ff: int) -> dict:
        D = self.args.hidden_size
        return {"expert_gate": (n_ff, D), "expert_up": (n_ff, D), "expert_down": (D, n_ff)}

    # ---- shared ----
    def kv_layout(self) -> tuple[dict, dict, frozenset]:
        # what one sequence keeps per token and layer (KVPool's shapes and views, KVCache's
        # flat names): standard attention's keys and values; a family with its own attention
        # (a compressed latent, say) says what it keeps
        sp = self.attn_spec
        return {"k": (self.n_layer, sp.n_kv_head, sp.head_dim), "v": (self.n_layer, sp.n_kv_head, sp.hv)}, {}, \
            frozenset()

    @functools.cached_property
    def kv_pool(self) -> KVPool:
        shapes, views, _ = self.kv_layout()
        return KVPool(shapes, views)

    def state_layout(self) -> dict[str, tuple]:
        # what one sequence keeps of fixed size whatever its length (KVCache.state: name ->
        # shape): nothing for attention; a hybrid's linear layers keep their recurrent state
        return {}

    def state_bytes_per_sequence(self) -> int:
        """What one sequence's recurrent state takes, however long it is (0: attention only)."""
        return sum(int(np.prod(shape)) * 4 for shape in self.state_layout().values())

    def new_cache(self, n_ctx: int) -> KVCache:
        return KVCache(self.kv_pool, min(n_ctx, self.n_ctx), self.kv_layout()[2], self.state_layout())

    def forward(self, ids: np.ndarray, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        # ids [T] int -> logits [T, V] (all_logits) or [1, V] (the last position)
        return self.forward_batch([(ids, cache)], all_logits)[0]

    def forward_batch(self, seqs: list[tuple[np.ndarray, KVCache]], all_logits: bool = False) -> list[np.ndarray]:
        # one step (see _forward_batch), its parallel work on one crew of threads (crew.Crew)
        sizes = [np.size(i) for i, _ in seqs]
        with crew_session(self.experts.int4_group, np.repeat(np.asarray(sizes) > 1, sizes)):
            return self._forward_batch(seqs, all_logits)

    def _forward_batch(self, seqs: list[tuple[np.ndarray, KVCache]], all_logits: bool) -> list[np.ndarray]:
        # seqs: (ids [T_i], cache) per sequence -> logits [T_i, V] or [1, V] per sequence. One step:
        # the sequences' tokens are the rows of one batch; each row's result is the same as alone.
        ids = np.concatenate([np.asarray(i, dtype=np.int64).reshape(-1) for i, _ in seqs])  # [T]
        segments, start, tables = [], 0, []
        for i, cache in seqs:
            n = len(i)
            segments.append(Segment(cache, start, n))
            tables.append(self.rope.table(cache.n_pos, n))
            start += n
        step = Step(segments, np.concatenate([c for c, _ in tables]), np.concatenate([s for _, s in tables]))
        h = self.embed(ids)  # [T, D] (DeepSeek-V4: [T, hc_mult, D])
        self.begin_layers(step)
        self.experts.begin_step()
        lookahead = self.experts.lookahead
        if lookahead and self.moe_layers:  # the first MoE layer's, from the embeddings
            self.lookahead(self.moe_layers[0], h)
        for il in range(self.n_layer):
            h = self.block(il, h, step)
            self.beat = time.monotonic()  # progress a watchdog can see, a layer at a time
            if lookahead and il + 1 < self.n_layer and self.is_moe(il + 1):
                self.lookahead(il + 1, h)
        for sg in segments:
            sg.cache.n_pos += sg.n
        rows = np.arange(len(ids)) if all_logits else np.array([sg.start + sg.n - 1 for sg in segments])
        logits = self.logits(self.final_norm(self.head_input(h[rows])))  # [R, V]
        if not all_logits:
            return [logits[i : i + 1] for i in range(len(segments))]
        return [logits[sg.start : sg.start + sg.n] for sg in segments]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        # ids [T] -> the residual stream at the first layer: [T, D], the embeddings in float32
        # (a table in a GGUF block format: just the step's rows decoded)
        return embed_rows(self.glob["embed"], ids)

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        # x [R, D] the head's input -> what the output head takes: the final RMSNorm
        return rmsnorm(x, self.glob["norm"], self.args.rms_norm_eps)

    def logits(self, x: np.ndarray) -> np.ndarray:
        # x [R, D] after the final norm -> the logits [R, V] (a family may soft-cap them)
        return linear(x, self.lm_head)

    def begin_layers(self, step: Step) -> None:
        # the step's tokens embedded, before the first layer: what a family starts that early
        # (Qwen4-Exp: its n-gram tables' rows, read while the first layers compute)
        return None

    def head_input(self, h: np.ndarray) -> np.ndarray:
        # the residual stream's rows after the last layer -> [R, D], what the final norm takes
        return h

    def lookahead(self, il: int, h: np.ndarray) -> None:
        # h [T, D] after layer il-1 (the embeddings for the first MoE layer): layer il's norm and
        # router on it predict its experts, whose reads start now, while layer il's attention
        # runs. Only data moves: the real router decides. (Predicting two and three layers ahead
        # from the same h, while the next layer reads little, kept the disk busier but read 60 %
        # more unused experts and was not faster: measured, dropped.)
        ids, _ = self.router(il, self.moe_input(il, h))  # [T, A]: the family's own route()
        self.experts.prefetch(il, np.unique(ids).tolist(), len(h))

    def describe(self) -> dict:
        """Facts about the loaded model for stats and `colictl run --json`."""
        dense = sum(a.nbytes for a in self.glob.values()) + sum(a.nbytes for L in self.layers for a in L.values())
        return {
            "model_type": self.MODEL_TYPE,
            "attention": self.ATTENTION,
            "kv_bytes_per_token": self.kv_bytes_per_token(),
            "state_bytes_per_sequence": self.state_bytes_per_sequence(),
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "n_moe_layer": len(self.moe_layers),
            "precision": self.precision(),
            "dense_bytes": int(dense),
            "n_ctx": self.n_ctx,
            "experts": self.experts.describe(),
            **({"tables": self.tables.stats()} if getattr(self, "tables", None) is not None else {}),
            **({"note": self.note} if isinstance(self.note, str) else {}),
        }

    def precision(self) -> dict:
        """The weights' precision in use, and whether it is lossy against the source checkpoint."""
        if self.source_precision is not None:
            p = dict(self.source_precision)
        else:
            embed = self.glob["embed"]
            dt = embed.kind if isinstance(embed, QuantWeight) else DTYPE_NAMES[embed.dtype.str]
            fp8 = sorted({w.kind for L in self.layers for w in L.values() if isinstance(w, QuantWeight)})
            if isinstance(embed, QuantWeight):  # a GGUF file's blocks (Q4_K_M: q4_k+q6_k+q8_0), named together
                dt, fp8 = "+".join(sorted({embed.kind, *fp8})), []
            experts = self.experts.describe().get("experts_kind") or dt  # a checkpoint's: all resident
            p = {"dense": dt, "dense_fp8": fp8 or None, "experts": experts, "group_size": None, "lossy": False}
        p["activations"] = self.activations
        p["lossy"] = bool(p["lossy"] or self.activations != "float32")
        return p
