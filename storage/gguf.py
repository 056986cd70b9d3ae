"""GGUF files, llama.cpp's format, read as a checkpoint: one file or a split set
(`NAME-00001-of-00003.gguf`), its metadata turned into the family's config.json, its
tensors named as the family names them (llama.cpp's names mapped through the `gguf`
package's own table, its stacked `ffn_*_exps` tensors as one slice per expert).

Everything is checked before a byte of weight is read: the file's structure (through the
`gguf` package, llama.cpp's Python reader), every tensor inside its file, every tensor's
type, the architecture; then, as for a safetensors checkpoint, each tensor the family
needs with the shape its config implies (`expect`). Each way of being wrong has its
named error, and the message names the file and the tensor.

Which GGUF types are computed, as they are stored: F32, F16 and BF16 (the same kernels as
a checkpoint's), and the block formats of storage/formats/ggml.py (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, Q2_K .. Q6_K, IQ4_NL, IQ4_XS, MXFP4) as QuantWeights of their blocks; any other type
is refused, naming it.
"""

import os
import re
from dataclasses import dataclass

import numpy as np

from .errors import (
    ArchitectureUnsupported,
    GGUFInvalid,
    ModelNotFound,
    TensorMissing,
    TensorShapeMismatch,
    TokenizerUnsupported,
    UnsupportedDtype,
)
from .formats import FORMATS, ggml
from .quant import QuantWeight
from .safetensors import TensorEntry

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # GGUF type -> storage dtype (bf16 as bits)
INT_TYPES = {"I32": np.int32}  # integer tables (DeepSeek-V4's token -> experts map)
EXPERT = re.compile(r"^(?P<layer>model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)"
                    r"\.(?P<suffix>weight|bias)$")


def is_gguf(path: str) -> bool:
    return str(path).endswith(".gguf")


def split_parts(path: str) -> list[str]:
    """The files of the model `path` names: itself, or every part of its split set (any part
    names the set). Raises ModelNotFound, GGUFInvalid (a part missing)."""
    path = str(path)
    if not os.path.isfile(path):
        raise ModelNotFound(f"{path}: no such GGUF file")
    m = SPLIT.match(path)
    if not m:
        return [path]
    n = int(m["n"])
    parts = [f"{m['stem']}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    missing = [p for p in parts if not os.path.isfile(p)]
    if missing:
        raise GGUFInvalid(f"{path}: part of a split set of {n}, and {missing[0]} is missing"
                          + (f" ({len(missing)} parts missing)" if len(missing) > 1 else ""))
    return parts


@dataclass
class GGUFTensor:
    name: str  # llama.cpp's
    file: str
    dtype: str  # the GGUF type's name: F32, F16, BF16, Q8_0, ...
    shape: tuple[int, ...]  # numpy's order (GGUF lists the dimensions innermost first)
    begin: int  # absolute offset in its file
    n_bytes: int
    data: np.ndarray  # the bytes, mapped
    derive: object = None  # a tensor put together from others (deepseek2's kv_b): () -> its float32 values


@dataclass
class GGUFPart:
    path: str
    file_bytes: int
    data_begin: int  # where its tensors' data starts: the header before it (convert's fingerprint hashes it)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_parts(paths: list[str], begins: dict | None = None) -> tuple[dict, dict[str, GGUFTensor]]:
    """(metadata of the first part, every tensor by llama.cpp's name) of a GGUF file or split
    set, each tensor checked to lie inside its file (`begins`, when given, hears where each
    file's tensor data starts). Raises GGUFInvalid, UnsupportedDtype."""
    from gguf import GGUFReader

    meta, tensors = {}, {}
    for i, path in enumerate(paths):
        try:
            with open(path, "rb") as f:
                head = f.read(24)
        except OSError as e:
            raise GGUFInvalid(f"{path}: {e.strerror or e}") from None
        if head[:4] != b"GGUF" or len(head) < 24:
            raise GGUFInvalid(f"{path}: not a GGUF file: " + ("it does not start with the bytes GGUF" if head[:4] != b"GGUF"
                                                              else f"{len(head)} bytes, shorter than a GGUF header"))
        try:
            reader = GGUFReader(path)
        except (ValueError, KeyError, IndexError, OverflowError, TypeError, UnicodeDecodeError, MemoryError) as e:
            raise GGUFInvalid(f"{path}: not a GGUF file colibri can read ({_why(e, path)})") from None
        except OSError as e:
            raise GGUFInvalid(f"{path}: {e.strerror or e}") from None
        if i == 0:
            meta = {}
            for k in reader.fields:
                if k.startswith("GGUF."):
                    continue
                try:
                    meta[k] = _field(reader, k)
                except (UnicodeDecodeError, ValueError, IndexError) as e:
                    raise GGUFInvalid(f"{path}: metadata value {k!r} cannot be read ({_why(e)})") from None
        size = os.path.getsize(path)
        if begins is not None:
            begins[path] = int(reader.data_offset)
        for t in reader.tensors:
            if t.name in tensors:
                raise GGUFInvalid(f"{path}: tensor {t.name!r} is in two parts of the set")
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise GGUFInvalid(f"{path}: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes}, past the "
                                  f"file's end ({size} bytes): the file is truncated")
            tensors[t.name] = GGUFTensor(t.name, path, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())),
                                         int(t.data_offset), int(t.n_bytes), t.data)
    return meta, tensors


def _why(e: Exception, path: str | None = None) -> str:
    """What a GGUF reading error means, in words: numpy's and the gguf package's messages
    say it of their arrays, not of the file."""
    text = str(e).strip() or type(e).__name__
    m = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", text)
    if m:
        return f"unknown tensor type {m.group(1)}"
    if isinstance(e, UnicodeDecodeError):
        return f"a string that is not UTF-8 text (byte {e.start} of it)"
    if isinstance(e, MemoryError) or re.search(r"cannot reshape|smaller than requested|larger than|out of bounds|"
                                               r"mmap length|offset must be|negative dimensions|too large|changing to a larger dtype", text):
        size = os.path.getsize(path) if path and os.path.exists(path) else None
        return ("its header or tensor table is truncated or damaged: a count, length or offset in it points past "
                f"the file's end{f' ({size} bytes)' if size is not None else ''}")
    return text.splitlines()[0][:200]


# ---- architectures: llama.cpp's name -> the family's model_type and config.json ----

def _common(meta: dict, arch: str, tensors: dict, scaled: tuple = ()) -> dict:
    # what every MoE architecture's metadata says alike, under config.json's names; a rope
    # scaling other than those in `scaled` refused (the architecture maps them itself)
    def key(k, default=None):
        return meta.get(f"{arch}.{k}", default)

    n_head = key("attention.head_count")
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none", *scaled):
        raise ArchitectureUnsupported(f"{arch} with rope scaling {scaling!r}: not read from GGUF files yet")
    return {
        "hidden_size": key("embedding_length"), "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_head, "num_key_value_heads": key("attention.head_count_kv", n_head),
        "num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0), "max_position_embeddings": key("context_length", 32768),
        "vocab_size": tensors["token_embd.weight"].shape[0] if "token_embd.weight" in tensors else None,
        "tie_word_embeddings": "output.weight" not in tensors,
    }


def _olmoe(meta: dict, arch: str, tensors: dict) -> dict:
    # OLMoE: q and k normed over the whole projection, the top-k weights not renormalised
    # (llama.cpp's olmoe graph: build_moe_ffn(..., false, ...)); its experts' width is the
    # feed-forward length. The rotary halves as HF's (llama.cpp's NEOX: its converter permutes nothing)
    if meta.get(f"{arch}.attention.clamp_kqv") is not None:
        raise ArchitectureUnsupported(f"{arch} with clamp_kqv: not read from GGUF files yet")
    return _common(meta, arch, tensors) | {
        "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "norm_topk_prob": False,
        "intermediate_size": meta.get(f"{arch}.expert_feed_forward_length") or meta.get(f"{arch}.feed_forward_length")}


def _llama(meta: dict, arch: str, tensors: dict) -> dict:
    # llama with experts: Mixtral (softmax over the top-k router logits: renormalised, as
    # llama.cpp's graph: build_moe_ffn(..., true, ...)); its converter permuted q and k's rows
    # for its interleaved rotary (undone as they are read: GGUFCheckpoint.read). No sliding
    # window: llama.cpp's llama graph has none
    if not meta.get(f"{arch}.expert_count"):
        raise ArchitectureUnsupported(f"{arch} without experts: a dense model, which colibri does not run")
    return _common(meta, arch, tensors) | {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
        "intermediate_size": meta.get(f"{arch}.expert_feed_forward_length") or meta.get(f"{arch}.feed_forward_length"),
        "head_dim": meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")}


def _glm4moe(meta: dict, arch: str, tensors: dict) -> dict:
    # GLM-4.5 / 4.6 / 4.7: leading dense layers, shared experts, the sigmoid router with its
    # score correction bias, routed_scaling_factor, partial rotary (its dimension count of the
    # head's, NEOX: nothing permuted), q/k norms and q/k/v biases where the file has them. The
    # file's MTP layers (block_count counts them) are never read. llama.cpp's graph groups no
    # experts: one group
    def key(k, default=None):
        return meta.get(f"{arch}.{k}", default)

    if key("expert_gating_func", 2) != 2:
        raise ArchitectureUnsupported(f"{arch} with expert gating {key('expert_gating_func')}: colibri reads its "
                                      "sigmoid gating (2)")
    cfg = _common(meta, arch, tensors)
    head_dim = key("attention.key_length") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {k: v for k, v in cfg.items() if k != "num_experts"} | {
        "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"],
        "num_hidden_layers": cfg["num_hidden_layers"] - key("nextn_predict_layers", 0),
        "intermediate_size": key("feed_forward_length"), "moe_intermediate_size": key("expert_feed_forward_length"),
        "n_routed_experts": key("expert_count"), "n_shared_experts": key("expert_shared_count", 0),
        "first_k_dense_replace": key("leading_dense_block_count", 0),
        "routed_scaling_factor": key("expert_weights_scale", 1.0), "norm_topk_prob": bool(key("expert_weights_norm")),
        "n_group": 1, "topk_group": 1, "head_dim": head_dim,
        "partial_rotary_factor": key("rope.dimension_count", head_dim // 2) / head_dim,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors, "attention_bias": "blk.0.attn_q.bias" in tensors}


def _minimax_m2(meta: dict, arch: str, tensors: dict) -> dict:
    # MiniMax-M2: q and k normed over the whole projection, the sigmoid router with its score
    # correction bias, top-k renormalised, partial rotary (rope.dimension_count; NEOX, nothing
    # permuted)
    if meta.get(f"{arch}.expert_gating_func", 2) != 2:
        raise ArchitectureUnsupported(f"{arch} with expert gating {meta.get(f'{arch}.expert_gating_func')}: colibri "
                                      "reads its sigmoid gating (2)")
    cfg = _common(meta, arch, tensors)
    head_dim = meta.get(f"{arch}.attention.key_length") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {k: v for k, v in cfg.items() if k != "num_experts"} | {
        "model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"], "num_local_experts": cfg["num_experts"],
        "intermediate_size": meta.get(f"{arch}.expert_feed_forward_length") or meta.get(f"{arch}.feed_forward_length"),
        "head_dim": head_dim, "rotary_dim": meta.get(f"{arch}.rope.dimension_count", head_dim)}


def _gpt_oss(meta: dict, arch: str, tensors: dict) -> dict:
    # gpt-oss: attention sinks, sliding and full layers in turn (llama.cpp's pattern of two: the
    # even layers slide, as the checkpoints' default layer_types), q/k/v/o biases, the router's
    # bias, the experts' biases and clamped SwiGLU (llama.cpp's constants alpha 1.702, limit
    # 7.0: the checkpoints'), YaRN rotary (NEOX: nothing permuted; `truncate` false, as the
    # published checkpoints say: the file cannot)
    def key(k, default=None):
        return meta.get(f"{arch}.{k}", default)

    cfg = _common(meta, arch, tensors, scaled=("yarn",))
    rope = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if key("rope.scaling.type") == "yarn":
        rope |= {"rope_type": "yarn", "factor": key("rope.scaling.factor"), "truncate": False,
                 "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                 "beta_fast": key("rope.scaling.yarn_beta_fast", 32.0), "beta_slow": key("rope.scaling.yarn_beta_slow", 1.0)}
    return {k: v for k, v in cfg.items() if k != "num_experts"} | {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_local_experts": cfg["num_experts"],
        "intermediate_size": key("expert_feed_forward_length"), "sliding_window": key("attention.sliding_window"),
        "head_dim": key("attention.key_length") or cfg["hidden_size"] // cfg["num_attention_heads"],
        "attention_bias": "blk.0.attn_q.bias" in tensors, "rope_parameters": rope}


def _qwen_moe(meta: dict, arch: str, tensors: dict) -> dict:
    # qwen3moe and qwen2moe (a shared expert gated by a sigmoid, q/k/v biases)
    def key(k, default=None):
        return meta.get(f"{arch}.{k}", default)

    cfg = _common(meta, arch, tensors) | {
        "intermediate_size": key("feed_forward_length", 0) or key("expert_feed_forward_length"),
        "moe_intermediate_size": key("expert_feed_forward_length")}
    if arch == "qwen3moe":
        # llama.cpp's qwen3moe graph renormalises the top-k weights always (build_moe_ffn(..., true, ...)),
        # its qwen2moe graph never
        cfg |= {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "norm_topk_prob": True}
        if key("attention.key_length") is not None:
            cfg["head_dim"] = key("attention.key_length")
    else:
        cfg |= {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "norm_topk_prob": False,
                "shared_expert_intermediate_size": key("expert_shared_feed_forward_length"),
                "qkv_bias": "blk.0.attn_q.bias" in tensors}
    return cfg


def _deepseek2(meta: dict, arch: str, tensors: dict) -> dict:
    # DeepSeek-V3/R1, Kimi K2 (deepseek_v3): MLA (llama.cpp's converter splits kv_b into k_b,
    # transposed, and v_b: put together again as they are read, GGUFCheckpoint.read), the
    # sigmoid router with its score correction bias, expert groups, leading dense layers,
    # shared experts; the rotary interleaved (llama.cpp's NORM rope: HF's rope_interleave).
    # YaRN as llama.cpp reads it: yarn_log_multiplier is 0.1 x mscale_all_dim, and llama.cpp
    # takes mscale = mscale_all_dim, so the rotary keeps magnitude 1 and the softmax scale
    # gets (0.1 m ln(factor) + 1)^2, what HF computes with mscale = mscale_all_dim = m
    def key(k, default=None):
        return meta.get(f"{arch}.{k}", default)

    if key("expert_gating_func", 2 if arch == "glm-dsa" else None) != 2:  # (llama.cpp's glm-dsa default: sigmoid)
        raise ArchitectureUnsupported(f"{arch} with expert gating {key('expert_gating_func')} (DeepSeek-V2's "
                                      "softmax): colibri reads DeepSeek-V3's sigmoid gating (2)")
    cfg = _common(meta, arch, tensors, scaled=("yarn",))
    rope_dim = key("rope.dimension_count")
    k_mla = key("attention.key_length_mla") or key("attention.key_length")  # (files before the _mla keys)
    rope = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if key("rope.scaling.type") == "yarn":
        if not key("rope.scaling.yarn_log_multiplier"):
            raise ArchitectureUnsupported(f"{arch} with YaRN and no yarn_log_multiplier: not read from GGUF files")
        m = key("rope.scaling.yarn_log_multiplier") / 0.1
        rope |= {"rope_type": "yarn", "factor": key("rope.scaling.factor"), "mscale": m, "mscale_all_dim": m,
                 "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                 "beta_fast": key("rope.scaling.yarn_beta_fast", 32.0), "beta_slow": key("rope.scaling.yarn_beta_slow", 1.0)}
    return {k: v for k, v in cfg.items() if k != "num_experts"} | _mla_moe(meta, arch) | {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": cfg["num_hidden_layers"] - key("nextn_predict_layers", 0),
        "norm_topk_prob": bool(key("expert_weights_norm")),
        "qk_nope_head_dim": k_mla - rope_dim if k_mla and rope_dim else None,
        "v_head_dim": key("attention.value_length_mla") or key("attention.value_length"), "head_dim": rope_dim,
        "rope_interleave": True, "rope_parameters": rope}


def _mla_moe(meta: dict, arch: str) -> dict:
    # what deepseek2's and kimi-linear's metadata say alike: MLA's ranks and rotary dims (one KV
    # head in the file: the config's are the attention heads), DeepSeek-V3's router and experts
    def key(k, default=None):
        return meta.get(f"{arch}.{k}", default)

    return {
        "num_key_value_heads": key("attention.head_count"),  # (llama.cpp writes MLA as one KV head)
        "intermediate_size": key("feed_forward_length"), "moe_intermediate_size": key("expert_feed_forward_length"),
        "n_routed_experts": key("expert_count"), "n_shared_experts": key("expert_shared_count", 0),
        "first_k_dense_replace": key("leading_dense_block_count", 0),
        "routed_scaling_factor": key("expert_weights_scale", 1.0),
        "n_group": key("expert_group_count", 1), "topk_group": key("expert_group_used_count", 1),
        "q_lora_rank": key("attention.q_lora_rank"), "kv_lora_rank": key("attention.kv_lora_rank"),
        "qk_rope_head_dim": key("rope.dimension_count")}


def _glm_dsa(meta: dict, arch: str, tensors: dict) -> dict:
    # GLM-5 (glm_moe_dsa): deepseek2's MLA and router with DeepSeek Sparse Attention's indexer:
    # its heads, key length and top-k, and which layers compute their own top-k (`types`: the
    # rest reuse the previous one's); without them, GLM-5/5.1 (a context under 1M) index on
    # every layer, as llama.cpp reads them. Its rotary is interleaved (the family's own)
    types = meta.get(f"{arch}.attention.indexer.types")
    if types is None and meta.get(f"{arch}.context_length", 0) >= 1 << 20:
        raise ArchitectureUnsupported(f"{arch} without attention.indexer.types: which layers index is not in the file")
    cfg = _deepseek2(meta, arch, tensors)
    n = cfg["num_hidden_layers"]
    return {k: v for k, v in cfg.items() if k != "rope_interleave"} | {
        "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"],
        "index_n_heads": meta.get(f"{arch}.attention.indexer.head_count"),
        "index_head_dim": meta.get(f"{arch}.attention.indexer.key_length"),
        "index_topk": meta.get(f"{arch}.attention.indexer.top_k"),
        "indexer_types": ["full" if t else "shared" for t in types[:n]] if types is not None else ["full"] * n}


def _qwen3next(meta: dict, arch: str, tensors: dict) -> dict:
    # Qwen3-Next (qwen3next) and Qwen3.5/3.6 (qwen35moe): Gated DeltaNet layers between full
    # ones (recurrent_layers, else every full_attention_interval-th layer full), in the layout
    # llama.cpp's converter writes (the family's gguf_layout: split projections, norms stored
    # as 1 + w, A_log as A, the convolution squeezed; Qwen3.5's value heads tiled). Its graphs
    # renormalise the top-k weights always
    def key(k, default=None):
        return meta.get(f"{arch}.{k}", default)

    cfg = _common(meta, arch, tensors)
    n = cfg["num_hidden_layers"] - key("nextn_predict_layers", 0)
    recurrent, every = key("attention.recurrent_layers"), key("full_attention_interval", 4)
    head_dim, rope_dim, Hv = key("attention.key_length"), key("rope.dimension_count"), key("ssm.time_step_rank")
    dense = {"intermediate_size": key("feed_forward_length")} if key("feed_forward_length") else {}
    return {k: v for k, v in cfg.items() if k != "rope_theta"} | dense | {
        "model_type": "qwen3_next" if arch == "qwen3next" else "qwen3_5_moe",
        "architectures": ["Qwen3NextForCausalLM" if arch == "qwen3next" else "Qwen3_5MoeForCausalLM"],
        "num_hidden_layers": n, "head_dim": head_dim, "norm_topk_prob": True,
        "layer_types": ["linear_attention" if (recurrent[il] if recurrent is not None else (il + 1) % every)
                        else "full_attention" for il in range(n)],
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "shared_expert_intermediate_size": key("expert_shared_feed_forward_length"),
        "linear_conv_kernel_dim": key("ssm.conv_kernel"), "linear_key_head_dim": key("ssm.state_size"),
        "linear_num_key_heads": key("ssm.group_count"), "linear_num_value_heads": Hv,
        "linear_value_head_dim": key("ssm.inner_size") // Hv if Hv and key("ssm.inner_size") else None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                            "partial_rotary_factor": rope_dim / head_dim if rope_dim and head_dim else None},
        "gguf_layout": True, "v_heads_tiled": arch == "qwen35moe"}


def _kimi_linear(meta: dict, arch: str, tensors: dict) -> dict:
    # Kimi Linear: KDA layers (a head_count_kv of 0) between MLA ones (no rotary; kv_b split as
    # deepseek2's), DeepSeek-V3's sigmoid router, leading dense layers, shared experts; the KDA
    # heads are the attention heads (llama.cpp's graph), A_log stored as A (gguf_layout). Its
    # graph renormalises the top-k weights always
    def key(k, default=None):
        return meta.get(f"{arch}.{k}", default)

    if key("expert_gating_func") != 2:
        raise ArchitectureUnsupported(f"{arch} with expert gating {key('expert_gating_func')}: colibri reads its "
                                      "sigmoid gating (2)")
    kv = key("attention.head_count_kv")
    cfg = {k: v for k, v in _common(meta, arch, tensors).items() if k not in ("num_experts", "rope_theta")}
    n, rope_dim = cfg["num_hidden_layers"], key("rope.dimension_count")
    kv = kv if isinstance(kv, list) else [kv] * n
    return cfg | _mla_moe(meta, arch) | {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "layer_types": ["linear_attention" if h == 0 else "full_attention" for h in kv[:n]],
        "linear_num_heads": cfg["num_attention_heads"], "linear_head_dim": key("kda.head_dim"),
        "linear_conv_kernel_dim": key("ssm.conv_kernel"), "norm_topk_prob": True,
        "qk_nope_head_dim": key("attention.key_length_mla") - rope_dim
        if key("attention.key_length_mla") and rope_dim else None,
        "v_head_dim": key("attention.value_length_mla"), "gguf_layout": True}


def _deepseek4(meta: dict, arch: str, tensors: dict) -> dict:
    # DeepSeek-V4 (Flash, Pro) as llama.cpp's DeepseekV4Model writes it: the layers' compress
    # ratios (0 sliding, 4 CSA, 128 HCA: the only ones its graph computes, as the family's
    # compress_ratios), the hash layers' count, hyper-connections, the grouped low-rank output,
    # the indexer; the main RoPE plain at rope.freq_base, the compressed layers' at
    # compress_rope_freq_base with the file's YaRN and without its attention factor (its
    # graph's dsv4_rope_attn_factor cancels it: the family's flat rope_scaling). One SwiGLU
    # clamp for routed and shared experts (the family's swiglu_limit); the top-k weights
    # renormalised (expert_weights_norm: the family does always, as transformers)
    def key(k, default=None):
        return meta.get(f"{arch}.{k}", default)

    def one(k, what):
        v = key(k)
        values = set(v if isinstance(v, list) else [v])
        if len(values) != 1 or None in values:
            raise ArchitectureUnsupported(f"{arch} with {what} {v!r}: colibri reads one for every layer")
        return values.pop()

    scoring = {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}.get(key("expert_gating_func"))
    if scoring is None:
        raise ArchitectureUnsupported(f"{arch} with expert gating {key('expert_gating_func')}: colibri reads "
                                      "sqrtsoftplus (4), sigmoid (2) and softmax (1)")
    if not key("expert_weights_norm", True):
        raise ArchitectureUnsupported(f"{arch} without expert_weights_norm: DeepSeek-V4 renormalises the top-k weights")
    limit = one("swiglu_clamp_exp", "swiglu_clamp_exp")
    if key("swiglu_clamp_shexp") is not None and one("swiglu_clamp_shexp", "swiglu_clamp_shexp") != limit:
        raise ArchitectureUnsupported(f"{arch} with a shared experts' SwiGLU clamp other than the routed ones'")
    cfg = {k: v for k, v in _common(meta, arch, tensors, scaled=("yarn",)).items() if k != "num_experts"}
    n = cfg["num_hidden_layers"] - key("nextn_predict_layers", 0)
    ratios = key("attention.compress_ratios")
    if ratios is not None and not set(ratios[:n]) <= {0, 4, 128}:
        raise ArchitectureUnsupported(f"{arch} with compress ratios {sorted(set(ratios[:n]))}: DeepSeek-V4's are "
                                      "0, 4 and 128")
    rope = {}
    if key("rope.scaling.type") == "yarn":
        rope = {"rope_scaling": {"type": "yarn", "factor": key("rope.scaling.factor"),
                                 "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                                 "beta_fast": key("rope.scaling.yarn_beta_fast", 32.0),
                                 "beta_slow": key("rope.scaling.yarn_beta_slow", 1.0)}}
    head_dim = key("attention.key_length")
    return cfg | rope | {
        "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": n,
        "head_dim": head_dim, "qk_rope_head_dim": key("rope.dimension_count"),
        "q_lora_rank": key("attention.q_lora_rank"), "sliding_window": key("attention.sliding_window"),
        "o_groups": key("attention.output_group_count"), "o_lora_rank": key("attention.output_lora_rank"),
        "compress_ratios": ratios[:n] if ratios is not None else None,
        "compress_rope_theta": key("attention.compress_rope_freq_base"),
        "index_n_heads": key("attention.indexer.head_count"), "index_head_dim": key("attention.indexer.key_length"),
        "index_topk": key("attention.indexer.top_k"),
        "hc_mult": key("hyper_connection.count"), "hc_sinkhorn_iters": key("hyper_connection.sinkhorn_iterations"),
        "hc_eps": key("hyper_connection.epsilon"), "num_hash_layers": key("hash_layer_count", 0),
        "n_routed_experts": key("expert_count"), "n_shared_experts": key("expert_shared_count", 0),
        "moe_intermediate_size": one("expert_feed_forward_length", "expert_feed_forward_length"),
        "scoring_func": scoring, "norm_topk_prob": True, "routed_scaling_factor": key("expert_weights_scale", 1.0),
        "swiglu_limit": limit}


# DeepSeek-V4's names, for which the gguf package (0.19) has no map: the family's (DeepSeek's
# own, as transformers saves them) -> llama.cpp's, as its converter (DeepseekV4Model) and its
# gguf-py constants write them
V4_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "head.weight": "output.weight", "model.hc_head.hc_fn": "output_hc_fn.weight",
             "model.hc_head.hc_base": "output_hc_base.weight", "model.hc_head.hc_scale": "output_hc_scale.weight"}
V4_LAYER = {
    "attn_norm.weight": "attn_norm", "ffn_norm.weight": "ffn_norm", "attn.attn_sink": "attn_sinks",
    "attn.wq_a.weight": "attn_q_a", "attn.q_norm.weight": "attn_q_a_norm", "attn.wq_b.weight": "attn_q_b",
    "attn.wkv.weight": "attn_kv", "attn.norm.weight": "attn_kv_a_norm",
    "attn.wo_a.weight": "attn_output_a", "attn.wo_b.weight": "attn_output_b",
    "attn.compressor.wkv.weight": "attn_compressor_kv", "attn.compressor.wgate.weight": "attn_compressor_gate",
    "attn.compressor.ape": "attn_compressor_ape", "attn.compressor.norm.weight": "attn_compressor_norm",
    "attn.indexer.wq_b.weight": "indexer.attn_q_b", "attn.indexer.weights_proj.weight": "indexer.proj",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate",
    "attn.indexer.compressor.ape": "indexer_compressor_ape", "attn.indexer.compressor.norm.weight": "indexer_compressor_norm",
    **{f"hc_{h}_{p}": f"hc_{h}_{p}" for h in ("attn", "ffn") for p in ("fn", "base", "scale")},
    "ffn.gate.weight": "ffn_gate_inp", "ffn.gate.bias": "exp_probs_b.bias", "ffn.gate.tid2eid": "ffn_gate_tid2eid",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp", "ffn.shared_experts.w3.weight": "ffn_up_shexp",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp",
    "ffn.experts.w1.weight": "ffn_gate_exps", "ffn.experts.w3.weight": "ffn_up_exps",
    "ffn.experts.w2.weight": "ffn_down_exps"}


def _deepseek4_name(name: str) -> tuple[str | None, int | None]:
    # the family's name -> (llama.cpp's, the expert's index in its stacked tensor or None)
    if name in V4_GLOBAL:
        return V4_GLOBAL[name], None
    m = re.match(r"^model\.layers\.(\d+)\.(?:ffn\.experts\.(\d+)\.(?=w))?(.+)$", name)
    if m is None:
        return None, None
    rest = f"ffn.experts.{m[3]}" if m[2] is not None else m[3]
    g = V4_LAYER.get(rest)
    return (None if g is None else f"blk.{m[1]}.{g}" + ("" if g.endswith(".bias") else ".weight"),
            None if m[2] is None else int(m[2]))


# llama.cpp's general.architecture -> its family's config.json
ARCHS = {"qwen3moe": _qwen_moe, "qwen2moe": _qwen_moe, "olmoe": _olmoe, "llama": _llama, "glm4moe": _glm4moe,
         "minimax-m2": _minimax_m2, "gpt-oss": _gpt_oss, "deepseek2": _deepseek2,
         "qwen3next": _qwen3next, "qwen35moe": _qwen3next, "kimi-linear": _kimi_linear,
         "glm-dsa": _glm_dsa, "deepseek4": _deepseek4}
TABLES = {"deepseek4": _deepseek4_name}  # architectures named by colibri's own table (none in the gguf package)
OPTIONAL = ("q_lora_rank",)  # config values a file may leave out (None: DeepSeek-V2-Lite's q has no LoRA)
PERMUTED = {"llama": ("attn_q.weight", "attn_k.weight")}  # rows llama.cpp's converter permuted for its rotary


def _token_ids(meta: dict) -> dict:
    # config.json's bos and eos ids from the tokenizer's metadata (what eos_ids reads): EOS, and
    # the end-of-turn and end-of-message tokens llama.cpp also stops on
    out = {}
    if (v := meta.get("tokenizer.ggml.bos_token_id")) is not None:
        out["bos_token_id"] = int(v)
    eos = [int(v) for k in ("eos", "eot", "eom") if (v := meta.get(f"tokenizer.ggml.{k}_token_id")) is not None]
    if eos:
        out["eos_token_id"] = list(dict.fromkeys(eos))
    return out


def gguf_config(meta: dict, tensors: dict, path: str) -> dict:
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ArchitectureUnsupported(f"{path}: architecture {arch!r} is not one colibri reads from GGUF "
                                      f"(it reads {', '.join(sorted(ARCHS))})")
    try:
        cfg = ARCHS[arch](meta, arch, tensors)
    except ArchitectureUnsupported as e:
        raise ArchitectureUnsupported(f"{path}: {e}") from None
    missing = sorted(k for k, v in cfg.items() if v is None and k not in OPTIONAL)
    if missing:
        raise GGUFInvalid(f"{path}: the metadata has no {arch}.* value for {', '.join(missing)}")
    return cfg | _token_ids(meta) | {"gguf_architecture": arch}


# ---- the checkpoint ----

NO_SCALES = np.zeros((1 << 20, 0), np.uint8)  # a block format's scales are in its blocks: [rows, 0], no bytes


def block_weight(gguf_type: str, q: np.ndarray) -> QuantWeight:
    """The QuantWeight of a block format's matrix: its blocks q uint8 [rows, row bytes] as
    stored (a GGUF file's, or a container's that kept them), no separate scales."""
    kind = ggml.BY_TYPE_NAME[gguf_type]
    return QuantWeight(kind, q, NO_SCALES[:q.shape[0]] if q.shape[0] <= len(NO_SCALES) else
                       np.zeros((q.shape[0], 0), np.uint8), FORMATS[kind].block[0])


def kinds_label(gguf_types) -> str:
    """GGUF types as colibri names a precision: q4_k+q6_k (Q4_K_M's experts), f32, ..."""
    return "+".join(sorted({ggml.BY_TYPE_NAME.get(t, t.lower()) for t in gguf_types}))


def block_shape(gguf_type: str, shape: tuple) -> tuple:
    """The bytes of a block format's matrix of `shape` [rows, columns]: [rows, row bytes]."""
    qk, nbytes = FORMATS[ggml.BY_TYPE_NAME[gguf_type]].block
    return (*shape[:-1], shape[-1] // qk * nbytes)

class GGUFCheckpoint:
    """A GGUF file (or split set) with the interface of storage/checkpoint.Checkpoint: the
    family's tensor names, entries in numpy's shapes, reads in the storage dtype."""

    quant = None
    crc32 = None
    int_dense = None

    def __init__(self, path: str):
        self.path = str(path)
        parts, begins = split_parts(self.path), {}
        self.meta, self.tensors = read_parts(parts, begins)
        self.config = gguf_config(self.meta, self.tensors, self.path)
        self.files = {os.path.basename(p): GGUFPart(p, os.path.getsize(p), begins[p]) for p in parts}
        import gguf

        self.table = TABLES.get(self.config["gguf_architecture"])
        if self.table is None:
            arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.config["gguf_architecture"])
            self._names = gguf.get_tensor_name_map(arch, int(self.config["num_hidden_layers"]))
        self.where = {}  # the family's name -> (llama.cpp's, expert index or None), filled as names are asked
        self.derived: dict[str, GGUFTensor] = {}  # tensors put together from the file's (_kv_b), by llama.cpp's name

    def _locate(self, name: str) -> tuple[GGUFTensor, int | None]:
        if name in self.where:
            gname, e = self.where[name]
            return self.tensors.get(gname) or self.derived[gname], e
        gname, e = self.table(name) if self.table is not None else self._mapped(name)
        t = self.tensors.get(gname) if gname else None
        if t is None and gname and gname.endswith(".attn_kv_b.weight"):
            t = self.derived[gname] = self._kv_b(gname)
        if t is None or (e is not None and (len(t.shape) < 2 or e >= t.shape[0])):
            raise TensorMissing(f"{self.path}: tensor {name!r} is missing"
                                + (f" (llama.cpp's {gname!r})" if gname else ""))
        self.where[name] = (gname, e)
        return t, e

    def _mapped(self, name: str) -> tuple[str | None, int | None]:
        # the family's name -> (llama.cpp's by the gguf package's map, the expert's index or None)
        m = EXPERT.match(name)
        spelled = re.sub(r"\.dt_bias$", ".dt_proj.bias", name.replace(
            "e_score_correction_bias", "e_score_correction.bias"))  # (as llama.cpp's converter renames them)
        if not spelled.endswith((".weight", ".bias")):  # a tensor named without a suffix (gpt-oss's sinks)
            spelled += ".weight"
        base, e = (f"{m['layer']}.{m['proj']}", int(m["e"])) if m else (spelled.rsplit(".", 1)[0], None)
        gname = self._names.get_name(base) or (self._names.get_name(name) if not m else None) or \
            self._names.get_name(base.replace(".block_sparse_moe.", ".mlp."))  # (Kimi Linear's dense layers)
        gname = f"{gname}.{spelled.rsplit('.', 1)[1]}" if gname and "." in name else None
        if gname and gname not in self.tensors and not name.endswith((".weight", ".bias")) and \
                gname.removesuffix(".weight") in self.tensors:
            gname = gname.removesuffix(".weight")  # a tensor llama.cpp names without a suffix (ssm_a)
        return gname, e

    def _kv_b(self, gname: str) -> GGUFTensor | None:
        """MLA's kv_b [heads x (nope + v), kv rank] from llama.cpp's k_b [heads, kv rank, nope]
        (its converter's transpose) and v_b [heads, v, kv rank], in float32: exactly the
        values stored (the family holds kv_b in float32 anyway, absorbed per head); None
        when the file has neither."""
        k_b, v_b = (self.tensors.get(gname.replace("attn_kv_b", p)) for p in ("attn_k_b", "attn_v_b"))
        if k_b is None or v_b is None:
            return None
        if len(k_b.shape) != 3 or len(v_b.shape) != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
            raise TensorShapeMismatch(f"{k_b.file}: {k_b.name} {list(k_b.shape)} and {v_b.name} {list(v_b.shape)} "
                                      "are not MLA's k_b [heads, kv rank, nope] and v_b [heads, v, kv rank]")
        heads, rank = k_b.shape[:2]
        shape = (heads * (k_b.shape[2] + v_b.shape[1]), rank)

        def derive():
            k, v = values(k_b), values(v_b)
            return np.concatenate([k.transpose(0, 2, 1), v], axis=1).reshape(shape)

        return GGUFTensor(gname, k_b.file, "F32", shape, k_b.begin, int(np.prod(shape)) * 4, None, derive)

    def name_all(self, names) -> None:
        """Take the family's tensor names (MoEModel.source): `where` then lists each one the file
        has, as a safetensors checkpoint's does (what convert walks)."""
        for name in names:
            self.has(name)  # (found: into `where`)

    def files_for_container(self) -> dict[str, str]:
        """What a container converted from this file keeps beside its weights, by file name:
        config.json, and the tokenizer (tokenizer.json, tokenizer_config.json) when the file
        has one colibri builds."""
        import json

        out = {"config.json": json.dumps(self.config, indent=2)}
        try:
            spec = tokenizer_spec(self.path)
        except TokenizerUnsupported:
            return out
        out["tokenizer.json"] = spec["json"]
        out["tokenizer_config.json"] = json.dumps({k: spec[k] for k in ("chat_template", "bos_token", "eos_token")})
        return out

    def has(self, name: str) -> bool:
        try:
            self._locate(name)
        except TensorMissing:
            return False
        return True

    def entry(self, name: str) -> TensorEntry:
        t, e = self._locate(name)
        if e is None:
            return TensorEntry(name, t.dtype, t.shape, t.begin, t.begin + t.n_bytes)
        per = t.n_bytes // t.shape[0]
        return TensorEntry(name, t.dtype, t.shape[1:], t.begin + e * per, t.begin + (e + 1) * per)

    def expect(self, name: str, shape: tuple[int, ...], integer: bool = False) -> TensorEntry:
        """As Checkpoint.expect. Raises TensorMissing, TensorShapeMismatch, UnsupportedDtype."""
        e = self.entry(name)
        t, _ = self._locate(name)
        if integer != (e.dtype in INT_TYPES):
            raise UnsupportedDtype(f"{t.file}: tensor {t.name!r} is {e.dtype}; " + (
                f"an integer table must be {', '.join(INT_TYPES)}" if integer else "a weight cannot be an integer"))
        if e.dtype not in FLOAT_TYPES and e.dtype not in ggml.BY_TYPE_NAME and not integer:
            raise UnsupportedDtype(f"{t.file}: tensor {t.name!r} is {e.dtype}; colibri computes GGUF's "
                                   f"{', '.join([*FLOAT_TYPES, *ggml.BY_TYPE_NAME])} tensors")
        if tuple(e.shape) != tuple(shape):
            raise TensorShapeMismatch(f"{t.file}: tensor {t.name!r} ({name!r}) has shape {list(e.shape)}, "
                                      f"the metadata implies {list(shape)}")
        if e.dtype in ggml.BY_TYPE_NAME and len(shape) != 2:
            raise UnsupportedDtype(f"{t.file}: tensor {t.name!r} is {e.dtype} with shape {list(shape)}; colibri "
                                   "computes block formats in matrices only (vectors as F32, F16 or BF16)")
        return e

    def read(self, name: str) -> np.ndarray:
        """A tensor in its storage dtype (bf16 as uint16), from the mapped file; a block
        format's: its blocks, uint8 [.., rows, row bytes]."""
        t, e = self._locate(name)
        if t.derive is not None:
            return t.derive()
        if t.dtype in ggml.BY_TYPE_NAME:
            a = np.asarray(t.data).reshape(-1).view(np.uint8).reshape(block_shape(t.dtype, t.shape))
        elif t.dtype in FLOAT_TYPES or t.dtype in INT_TYPES:
            a = np.asarray(t.data).reshape(-1).view(np.uint8).view({**FLOAT_TYPES, **INT_TYPES}[t.dtype]).reshape(t.shape)
        else:
            raise UnsupportedDtype(f"{t.file}: tensor {t.name!r} is {t.dtype}; not computed from GGUF")
        if t.name.endswith(PERMUTED.get(self.config["gguf_architecture"], ())):
            # each head's rows back from llama.cpp's order (its converter's LlamaModel.permute:
            # the rows of a head's first and second halves interleaved), whole rows of blocks
            heads = self.config["num_attention_heads" if "attn_q" in t.name else "num_key_value_heads"]
            a = a.reshape(heads, a.shape[0] // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        return np.array(a if e is None else a[e])

    def read_weight(self, name: str) -> "np.ndarray | QuantWeight":
        """A weight as colibri computes on it: an array in its storage dtype, or a block
        format's QuantWeight over its blocks as stored (storage/formats/ggml.py)."""
        t, _ = self._locate(name)
        q = self.read(name)
        return block_weight(t.dtype, q) if t.dtype in ggml.BY_TYPE_NAME else q

    def file_of(self, name: str) -> str:
        return self._locate(name)[0].file


def values(t: GGUFTensor) -> np.ndarray:
    """A tensor's float32 values (a block format's dequantised by the `gguf` package)."""
    raw = np.asarray(t.data).reshape(-1).view(np.uint8)
    if t.dtype in ggml.BY_TYPE_NAME:
        rows = raw.reshape(-1, block_shape(t.dtype, t.shape)[-1])
        return ggml.dequantize(ggml.BY_TYPE_NAME[t.dtype], rows).reshape(t.shape)
    if t.dtype not in FLOAT_TYPES:
        raise UnsupportedDtype(f"{t.file}: tensor {t.name!r} is {t.dtype}; not computed from GGUF")
    a = raw.view(FLOAT_TYPES[t.dtype]).reshape(t.shape)
    return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a.astype(np.float32)


# ---- the tokenizer, from the metadata ----

# tokenizer.ggml.pre -> the regex that splits text into words before the byte-level BPE (what
# llama.cpp's llama-vocab.cpp applies for each; "default" and "gpt-2": GPT-2's own, which the
# ByteLevel pre-tokenizer carries)
PRE_REGEX = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "default": None,
    "gpt-2": None,
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type: llama.cpp's token attributes


def tokenizer_spec(path: str) -> dict | None:
    """For a GGUF file, what engine/tokenizer.Tokenizer builds its tokenizer from: {"json": a
    tokenizer.json's text, "chat_template", "bos_token", "eos_token"} made from the file's
    tokenizer.ggml.* and tokenizer.chat_template metadata; None for a model directory.
    Raises what GGUFCheckpoint raises, TokenizerUnsupported (no tokenizer in the file, a
    tokenizer model or pre-tokenizer colibri does not build)."""
    import json

    if not is_gguf(path):
        return None
    meta, _ = read_parts(split_parts(path)[:1])
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise TokenizerUnsupported(f"{path}: no tokenizer in the file's metadata")
    if model != "gpt2" or pre not in PRE_REGEX:
        raise TokenizerUnsupported(f"{path}: tokenizer {model!r} with pre-tokenizer {pre!r}: colibri builds "
                                   f"'gpt2' (byte-level BPE) with {', '.join(sorted(PRE_REGEX))}")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": types[i] == CONTROL} for i, t in enumerate(tokens) if types[i] in (CONTROL, USER_DEFINED)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": PRE_REGEX[pre] is None}
    pre_tokenizer = byte_level if PRE_REGEX[pre] is None else {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": PRE_REGEX[pre]}, "behavior": "Isolated", "invert": False}, byte_level]}
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": pre_tokenizer, "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},  # (the added ones too: else `tokenizers` renumbers them)
                  "merges": list(meta.get("tokenizer.ggml.merges") or [])},
    }

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    return {"json": json.dumps(spec), "chat_template": meta.get("tokenizer.chat_template"),
            "bos_token": token("bos"), "eos_token": token("eos")}
