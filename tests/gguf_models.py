"""Tiny GGUF files written by the tests from tiny transformers checkpoints (hf_models.build),
with the `gguf` package's writer, in llama.cpp's layout: its tensor names, the experts of a
layer stacked in one tensor, the dimensions innermost first, the metadata its converter
writes. No llama.cpp build needed."""

import json
import os
import re

import numpy as np

from colibri.storage.checkpoint import open_checkpoint

TYPES = {"F32": np.float32, "F16": np.float16}
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama",  # -> llama.cpp's
        "glm4_moe": "glm4moe", "minimax_m2": "minimax-m2", "gpt_oss": "gpt-oss", "deepseek_v3": "deepseek2",
        "qwen3_next": "qwen3next", "qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe",
        "kimi_linear": "kimi-linear", "glm_moe_dsa": "glm-dsa", "deepseek_v4": "deepseek4"}
HYBRID = ("qwen3next", "qwen35moe")


def write_gguf(hf_dir, out, dtype="F32", split_max_tensors=0, tokenizer=None, pre="default", quant=None):
    """The checkpoint at hf_dir (qwen3_moe, every layer MoE, norm_topk_prob true: what
    llama.cpp's qwen3moe computes) as a GGUF file at `out` (split into parts of at most
    split_max_tensors tensors when given), with the tokenizer of the directory `tokenizer`
    (tokenizer.json, tokenizer_config.json) in its metadata as llama.cpp's converter writes a
    byte-level BPE (`pre`: its pre-tokenizer's name). quant(llama.cpp's name, array): the GGUF
    block type (Q4_K, ...) a matrix is written in, None for `dtype` (blocks: blocks()).
    Returns the path of the (first) file."""
    import gguf

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    arch = ARCH[cfg["model_type"]]
    # what llama.cpp computes: qwen3moe renormalises the top-k weights, qwen2moe and olmoe do not;
    # every layer MoE; olmoe without clip_qkv; glm4moe's experts in one group
    if arch in ("qwen3moe", "qwen2moe", "olmoe"):
        assert bool(cfg.get("norm_topk_prob")) == (arch == "qwen3moe")
    assert not cfg.get("mlp_only_layers") and not cfg.get("clip_qkv")
    assert cfg.get("n_group", 1) == 1 or arch in ("deepseek2", "glm-dsa")  # (llama.cpp groups these only)
    assert arch not in ("deepseek2", "glm-dsa") or (cfg.get("rope_interleave", True) and not cfg.get("attention_bias"))
    ck = open_checkpoint(str(hf_dir))
    L, E = cfg["num_hidden_layers"], cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts")))
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), L)
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    w.add_block_count(L)
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(cfg["hidden_size"])
    if "intermediate_size" in cfg:
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    mla = arch in ("deepseek2", "kimi-linear", "glm-dsa")  # (MLA as one KV head of kv rank + rope dims, as llama.cpp writes it)
    if arch == "kimi-linear":  # a KV head count a layer, 0 for the KDA ones
        w.add_head_count_kv([0 if t == "linear_attention" else 1 for t in cfg["layer_types"]])
    else:
        w.add_head_count_kv(1 if mla else cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] if mla else head_dim)
    w.add_value_length(cfg["kv_lora_rank"] if mla else head_dim)
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_rope_freq_base(float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(E)
    w.add_expert_used_count(cfg.get("num_experts_per_tok") or cfg["num_experts_per_token"])
    w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    if arch == "glm4moe":  # what llama.cpp's Glm4MoeModel writes
        rope = cfg.get("rope_parameters") or {}
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
    if arch == "gpt-oss":  # what llama.cpp's GptOssModel (and its base, for YaRN) writes
        w.add_sliding_window(cfg["sliding_window"])
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch == "kimi-linear":  # what llama.cpp's KimiLinearModel writes (groups: its base reads n_group only)
        assert cfg.get("num_expert_group", 1) == 1 and cfg["linear_num_heads"] == cfg["num_attention_heads"]
        lead = cfg["mlp_layer_types"].index("sparse")
        assert cfg["mlp_layer_types"] == ["dense"] * lead + ["sparse"] * (L - lead)  # (llama.cpp: leading dense only)
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_uint32(f"{arch}.kda.head_dim", cfg["linear_head_dim"])
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_kv_lora_rank(cfg["kv_lora_rank"])
        w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_expert_shared_count(cfg["num_shared_experts"])
        w.add_leading_dense_block_count(lead)
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if arch == "glm-dsa":  # what llama.cpp's GlmMoeDsaModel adds to deepseek2's
        w.add_indexer_head_count(cfg["index_n_heads"])
        w.add_indexer_key_length(cfg["index_head_dim"])
        w.add_indexer_top_k(cfg["index_topk"])
        w.add_array(f"{arch}.attention.indexer.types", [t == "full" for t in cfg["indexer_types"]])
    if arch in ("deepseek2", "glm-dsa"):  # what llama.cpp's DeepseekV2Model (and its base) writes
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_kv_lora_rank(cfg["kv_lora_rank"])
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        if cfg.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
        w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type") == "yarn":
            assert rope["mscale"] == rope["mscale_all_dim"]  # (what llama.cpp computes)
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_beta_fast(rope.get("beta_fast", 32.0))
            w.add_rope_scaling_yarn_beta_slow(rope.get("beta_slow", 1.0))
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if arch in HYBRID:  # what llama.cpp's Qwen3NextModel (and Qwen3_5MoeTextModel) writes
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        w.add_rope_dimension_count(int(head_dim * (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 0.25)))
    if arch == "minimax-m2":  # what llama.cpp's MiniMaxM2Model writes
        w.add_rope_dimension_count(cfg.get("rotary_dim") or head_dim)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if tokenizer is not None:
        add_tokenizer(w, tokenizer, pre)
    as_type = TYPES[dtype]

    def add(gname, a):
        if a.size == 0:  # (transformers' DeepSeek-V3 with no shared expert still has its empty matrices)
            return
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):  # as its converter permutes
            heads = cfg["num_attention_heads" if "attn_q" in gname else "num_key_value_heads"]
            a = a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        qtype = quant(gname, a) if quant is not None and a.ndim >= 2 else None
        if qtype is not None:
            w.add_tensor(gname, blocks(a, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])
            return
        a = np.ascontiguousarray(a.astype(np.float32) if a.ndim == 1 else a.astype(as_type))  # norms stay F32
        w.add_tensor(gname, a)

    def f32(name):
        a = ck.read(name)
        return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a.astype(np.float32)

    stacked = {}
    fused = __import__("re").compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
    for name in sorted(ck.where):
        if arch == "gpt-oss" and (m := fused.match(name)):  # split and transposed as llama.cpp's converter does
            a, il, suffix = f32(name), m[1], "bias" if m[3] else "weight"
            if m[2] == "down_proj":
                add(f"blk.{il}.ffn_down_exps.{suffix}", a if m[3] else np.ascontiguousarray(a.swapaxes(-1, -2)))
                continue
            a = a if m[3] else a.swapaxes(-1, -2)  # [E, 2I, D]: gate's rows and up's interleaved
            add(f"blk.{il}.ffn_gate_exps.{suffix}", np.ascontiguousarray(a[:, ::2]))
            add(f"blk.{il}.ffn_up_exps.{suffix}", np.ascontiguousarray(a[:, 1::2]))
            continue
        if arch == "kimi-linear" and (written := kimi_tensors(name, f32(name), cfg)) is not None:
            for gname, a in written:
                add(gname, a)
            continue
        if mla and name.endswith("kv_b_proj.weight"):  # split, k_b transposed, as its converter
            heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
            kv_b = f32(name).reshape(heads, nope + cfg["v_head_dim"], -1)
            il = name.split(".")[2]
            add(f"blk.{il}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)))
            add(f"blk.{il}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))
            continue
        if name.endswith(".sinks"):
            add(f"{names.get_name(name)}.weight", f32(name))
            continue
        if arch in HYBRID and (written := hybrid_tensors(name, f32(name), cfg, arch, names)) is not None:
            for gname, a in written:
                add(gname, a)
            continue
        m = __import__("re").match(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if m:
            stacked.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = f32(name)
            continue
        base, suffix = name.replace("e_score_correction_bias", "e_score_correction.bias").rsplit(".", 1)
        add(f"{names.get_name(base) or names.get_name(base.replace('.block_sparse_moe.', '.mlp.'))}.{suffix}",
            f32(name))
    for base, experts in sorted(stacked.items()):
        add(f"{names.get_name(base)}.weight", np.stack([experts[e] for e in range(E)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        stem = str(out)[: -len(".gguf")]
        return next(p for p in (f"{stem}-00001-of-{n:05d}.gguf" for n in range(1, 100)) if os.path.exists(p))
    return str(out)


# DeepSeek-V4's tensors as llama.cpp's converter names them (DeepseekV4Model._map_dsv4_tensor_name
# and gguf-py's constants, spelled out here: the gguf package on PyPI has no map for them)
V4_NAMES = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight", "attn.attn_sink": "attn_sinks.weight",
    "attn.wq_a.weight": "attn_q_a.weight", "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wq_b.weight": "attn_q_b.weight", "attn.wkv.weight": "attn_kv.weight", "attn.norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight", "attn.wo_b.weight": "attn_output_b.weight",
    "attn.compressor.wkv.weight": "attn_compressor_kv.weight", "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
    "attn.compressor.ape": "attn_compressor_ape.weight", "attn.compressor.norm.weight": "attn_compressor_norm.weight",
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight", "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
    "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
    "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
    "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
    "hc_attn_fn": "hc_attn_fn.weight", "hc_attn_base": "hc_attn_base.weight", "hc_attn_scale": "hc_attn_scale.weight",
    "hc_ffn_fn": "hc_ffn_fn.weight", "hc_ffn_base": "hc_ffn_base.weight", "hc_ffn_scale": "hc_ffn_scale.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight", "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight", "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight", "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight"}
V4_ROOT = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "head.weight": "output.weight", "model.hc_head.hc_fn": "output_hc_fn.weight",
           "model.hc_head.hc_base": "output_hc_base.weight", "model.hc_head.hc_scale": "output_hc_scale.weight"}
V4_EXPERTS = {"w1": "ffn_gate_exps", "w2": "ffn_down_exps", "w3": "ffn_up_exps"}


def write_deepseek4(hf_dir, out, quant=None):
    """A deepseek_v4 checkpoint as llama.cpp's DeepseekV4Model writes DeepSeek-V4: its names,
    the routed experts of a layer stacked per projection in MXFP4, the hash layers' tid2eid as
    I32, the metadata its converter writes (compress ratios 0/4/128 and leading hash layers:
    what its graph computes). quant(llama.cpp's name, array): the block type of any other
    matrix (its FP8 ones become Q8_0), None for F32. Returns the path."""
    import gguf

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    L, rates, types = cfg["num_hidden_layers"], cfg["compress_rates"], cfg["layer_types"]
    ratios = [0 if t == "sliding_attention" else rates[t] for t in types]
    hash_layers = cfg["mlp_layer_types"].count("hash_moe")
    assert set(ratios) <= {0, 4, 128} and cfg["mlp_layer_types"][:hash_layers] == ["hash_moe"] * hash_layers
    ck = open_checkpoint(str(hf_dir))
    arch, w = "deepseek4", gguf.GGUFWriter(str(out), "deepseek4")
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1)
    main, comp = cfg["rope_parameters"]["main"], cfg["rope_parameters"]["compress"]
    w.add_rope_freq_base(main["rope_theta"])
    if comp["rope_type"] == "yarn":  # (the hub's flat rope_scaling: the compressed layers')
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(comp["factor"])
        w.add_rope_scaling_orig_ctx_len(comp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(comp.get("beta_fast", 32.0))
        w.add_rope_scaling_yarn_beta_slow(comp.get("beta_slow", 1.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_uint32(f"{arch}.expert_gating_func", {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}[cfg["scoring_func"]])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_swiglu_clamp_exp([cfg["swiglu_limit"]] * L)
    w.add_swiglu_clamp_shexp([cfg["swiglu_limit"]] * L)
    w.add_indexer_head_count(cfg["index_n_heads"])
    w.add_indexer_key_length(cfg["index_head_dim"])
    w.add_indexer_top_k(cfg["index_topk"])
    w.add_uint32(f"{arch}.attention.output_group_count", cfg["o_groups"])
    w.add_uint32(f"{arch}.attention.output_lora_rank", cfg["o_lora_rank"])
    w.add_array(f"{arch}.attention.compress_ratios", ratios)
    w.add_float32(f"{arch}.attention.compress_rope_freq_base", cfg["compress_rope_theta"])
    w.add_uint32(f"{arch}.hyper_connection.count", cfg["hc_mult"])
    w.add_uint32(f"{arch}.hyper_connection.sinkhorn_iterations", cfg["hc_sinkhorn_iters"])
    w.add_float32(f"{arch}.hyper_connection.epsilon", cfg["hc_eps"])
    w.add_uint32(f"{arch}.hash_layer_count", hash_layers)
    w.add_embedding_length_out(cfg["hidden_size"] * cfg["hc_mult"])

    def f32(name):
        return ck.read(name).astype(np.float32)

    def add(gname, a):
        plain = quant is None or a.ndim != 2 or "hc_" in gname or gname.endswith("_ape.weight")  # (F32 in the release)
        qtype = None if plain else quant(gname, a)
        if qtype is not None:
            w.add_tensor(gname, blocks(a, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))

    stacked = {}
    for name in sorted(ck.where):
        if name in V4_ROOT:
            add(V4_ROOT[name], f32(name))
            continue
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
        if e := re.match(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$", m[2]):
            stacked.setdefault((int(m[1]), e[2]), {})[int(e[1])] = f32(name)
        elif m[2] == "ffn.gate.tid2eid":
            w.add_tensor(f"blk.{m[1]}.{V4_NAMES[m[2]]}", np.ascontiguousarray(ck.read(name), dtype=np.int32))
        else:
            add(f"blk.{m[1]}.{V4_NAMES[m[2]]}", f32(name))
    for (il, proj), experts in sorted(stacked.items()):
        a = np.stack([experts[e] for e in range(len(experts))])
        w.add_tensor(f"blk.{il}.{V4_EXPERTS[proj]}.weight", blocks(a, "MXFP4"),
                     raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(out)


def tiled(a, axis, cfg, head_dim, inverse=False):
    # Qwen3.5's value heads from grouped (by key head) to tiled order along `axis`, as llama.cpp's
    # converter (_LinearAttentionVReorderBase._reorder_v_heads) reorders them; `inverse`: back
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    a = np.moveaxis(a, axis, 0)
    shape = a.shape
    order = (hv // hk, hk) if inverse else (hk, hv // hk)
    a = a.reshape(*order, head_dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def hybrid_tensors(name, a, cfg, arch, names):
    """A Qwen3-Next / Qwen3.5 tensor as llama.cpp's converter writes it: [(its name, array)], or
    None for a tensor it writes as any other."""
    il = name.split(".")[2] if name.startswith("model.layers.") else None
    kd = cfg["linear_key_head_dim"] * cfg["linear_num_key_heads"]
    dv, r = cfg["linear_value_head_dim"], cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"]
    tile = arch == "qwen35moe" and r > 1
    if name.endswith("norm.weight") and ".linear_attn." not in name:  # the (1 + w) norms, stored as 1 + w
        return [(f"{names.get_name(name.removesuffix('.weight'))}.weight", a + np.float32(1))]
    if ".linear_attn." not in name:
        return None
    if name.endswith(".A_log"):
        return [(f"blk.{il}.ssm_a", tiled(-np.exp(a), 0, cfg, 1) if tile else -np.exp(a))]
    if name.endswith(".dt_bias"):
        return [(f"blk.{il}.ssm_dt.bias", tiled(a, 0, cfg, 1) if tile else a)]
    if name.endswith("conv1d.weight"):
        a = a.reshape(a.shape[0], -1)
        if tile:
            a = np.concatenate([a[:2 * kd], tiled(a[2 * kd:], 0, cfg, dv)])
        return [(f"blk.{il}.ssm_conv1d.weight", a)]
    if name.endswith("in_proj_qkvz.weight"):  # per key head [q, k, v, z] -> q, k, v of every head; z apart
        dk = cfg["linear_key_head_dim"]
        g = a.reshape(cfg["linear_num_key_heads"], 2 * dk + 2 * r * dv, -1)
        q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
        D = a.shape[1]
        return [(f"blk.{il}.attn_qkv.weight", np.concatenate([q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, D)])),
                (f"blk.{il}.attn_gate.weight", np.ascontiguousarray(z.reshape(-1, D)))]
    if not tile:
        return None
    if name.endswith("in_proj_qkv.weight"):
        return [(f"blk.{il}.attn_qkv.weight", np.concatenate([a[:2 * kd], tiled(a[2 * kd:], 0, cfg, dv)]))]
    if name.endswith("in_proj_z.weight"):
        return [(f"blk.{il}.attn_gate.weight", tiled(a, 0, cfg, dv))]
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
        return [(f"blk.{il}.ssm_{'alpha' if 'proj_a' in name else 'beta'}.weight", tiled(a, 0, cfg, 1))]
    if name.endswith("out_proj.weight"):
        return [(f"blk.{il}.ssm_out.weight", tiled(a, 1, cfg, dv))]
    return None


def kimi_tensors(name, a, cfg):
    """A Kimi Linear KDA tensor as llama.cpp's converter writes it, or None."""
    il = name.split(".")[2] if name.startswith("model.layers.") else None
    if name.endswith(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")):
        return [(f"blk.{il}.ssm_conv1d_{name.split('.')[-2][0]}.weight", a.reshape(1, a.shape[0], 1, -1))]
    if name.endswith(".A_log"):
        return [(f"blk.{il}.ssm_a", -np.exp(a))]
    if name.endswith(".dt_bias"):
        return [(f"blk.{il}.ssm_dt.bias", a)]
    return None


def hybrid_values(name, values, cfg, arch):
    """The transformers tensor `name` of a Qwen3-Next / Qwen3.5 checkpoint from the values
    the GGUF file holds (values(family name)): hybrid_tensors undone; None for any other."""
    kd = cfg["linear_key_head_dim"] * cfg["linear_num_key_heads"]
    dv, r = cfg["linear_value_head_dim"], cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"]
    tile = arch == "qwen35moe" and r > 1

    def back(a, axis, head_dim):
        return tiled(a, axis, cfg, head_dim, inverse=True) if tile else a

    if name.endswith("norm.weight") and ".linear_attn." not in name:
        return values(name) - np.float32(1)
    if ".linear_attn." not in name:
        return None
    if name.endswith(".A_log"):
        return back(np.log(-values(name)), 0, 1)
    if name.endswith(".dt_bias"):
        return back(values(name), 0, 1)
    if name.endswith("conv1d.weight"):
        a = values(name)
        return np.concatenate([a[:2 * kd], back(a[2 * kd:], 0, dv)])[:, None, :]
    if name.endswith("in_proj_qkvz.weight"):
        base = name.removesuffix("in_proj_qkvz.weight")
        qkv, z = values(base + "in_proj_qkv.weight"), values(base + "in_proj_z.weight")
        dk, hk, D = cfg["linear_key_head_dim"], cfg["linear_num_key_heads"], qkv.shape[1]
        q, k, v = qkv[:kd].reshape(hk, dk, D), qkv[kd:2 * kd].reshape(hk, dk, D), qkv[2 * kd:].reshape(hk, r * dv, D)
        return np.concatenate([q, k, v, z.reshape(hk, r * dv, D)], axis=1).reshape(-1, D)
    a = values(name)
    if name.endswith("in_proj_qkv.weight"):
        return np.concatenate([a[:2 * kd], back(a[2 * kd:], 0, dv)])
    if name.endswith("in_proj_z.weight"):
        return back(a, 0, dv)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
        return back(a, 0, 1)
    if name.endswith("out_proj.weight"):
        return back(a, 1, dv)
    return a


def add_tokenizer(w, directory, pre):
    tok = json.load(open(os.path.join(directory, "tokenizer.json")))
    cfg = json.load(open(os.path.join(directory, "tokenizer_config.json")))
    ids = dict(tok["model"]["vocab"]) | {a["content"]: a["id"] for a in tok["added_tokens"]}
    tokens = sorted(ids, key=ids.get)
    assert [ids[t] for t in tokens] == list(range(len(tokens)))
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    for name, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id)):
        t = cfg.get(name)
        t = t.get("content") if isinstance(t, dict) else t
        if t in ids:
            add(ids[t])
    if cfg.get("chat_template"):
        w.add_chat_template(cfg["chat_template"])


# where each block type keeps its float16 scales (byte offsets in a block): what blocks() sets
F16_AT = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}
RANGE = {"Q2_K": 3 * 15, "Q3_K": 4 * 32, "Q4_K": 15 * 63, "Q5_K": 31 * 63, "Q6_K": 32 * 127, "IQ4_XS": 127 * 32}  # |code x scale| max


def blocks(a, qtype, seed=0):
    """a [..., N, D] float32 -> the blocks [..., N, D / block x block bytes] of GGUF type
    `qtype`: the `gguf` package's quantiser where it has one (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
    MXFP4, IQ4_NL has none); for the others (the K-quants, IQ4_*) random valid blocks whose
    weights spread as a's do (the package cannot write them: tests compare with the weights
    dequantised from the file, whatever they are)."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    try:
        return gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), t)
    except NotImplementedError:
        pass
    qk, nbytes = gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    *lead, n, d = a.shape
    out = rng.integers(0, 256, (*lead, n, d // qk, nbytes), dtype=np.uint8)
    spread = float(np.abs(a).max()) or 1.0
    for o in F16_AT.get(qtype, (0,)):  # d (and dmin) so that a code times its scale stays within a's range
        s = (rng.uniform(0.3, 1.0, out.shape[:-1]) * spread / RANGE.get(qtype, 127 * 8)).astype(np.float16)
        out[..., o : o + 2] = s[..., None].view(np.uint8)
    return out.reshape(*lead, n, d // qk * nbytes)


def dequantized_reference(gguf_path, hf_dir, out_dir):
    """transformers' model of the checkpoint at hf_dir with every weight what the GGUF file at
    gguf_path holds, dequantised by the `gguf` package (a copy at out_dir): it computes on
    exactly the weights the file stands for."""
    import shutil

    import torch
    import transformers
    from safetensors.numpy import save_file

    from colibri.storage.quant import QuantWeight, dequantize

    from hf_models import CLASSES, REFERENCE

    shutil.copytree(hf_dir, out_dir)
    src, ck = open_checkpoint(str(gguf_path)), open_checkpoint(str(hf_dir))

    def values(name):
        w = src.read_weight(name)
        if isinstance(w, QuantWeight):
            return dequantize(w)
        return w.astype(np.int64) if w.dtype.kind == "i" else w.astype(np.float32)  # (an integer table as transformers')

    tensors = {}
    fused = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    arch = ARCH[cfg["model_type"]]
    for name in ck.where:
        if m := fused.match(name):  # gpt-oss's fused experts, put together again from the file's gate and up
            E, one = ck.entry(name).shape[0], f"model.layers.{m[1]}.mlp.experts.{{}}.{{}}.{'bias' if m[3] else 'weight'}"
            if m[2] == "down_proj":
                parts = [values(one.format(e, "down_proj")) for e in range(E)]
                tensors[name] = np.stack(parts if m[3] else [p.T for p in parts])
                continue
            gate, up = ([values(one.format(e, p)) for e in range(E)] for p in ("gate_proj", "up_proj"))
            both = np.stack([np.stack([g, u], axis=-1).reshape(*g.shape[:-1], -1) if m[3]
                             else np.stack([g.T, u.T], axis=-1).reshape(g.shape[1], -1) for g, u in zip(gate, up)])
            tensors[name] = both
            continue
        if arch == "kimi-linear" and name.endswith((".A_log", "conv1d.weight")):  # kimi_tensors undone
            a = values(name)
            tensors[name] = np.log(-a) if name.endswith(".A_log") else a.reshape(a.shape[1], 1, -1)
            continue
        if arch in HYBRID and (a := hybrid_values(name, values, cfg, arch)) is not None:
            tensors[name] = a
            continue
        tensors[name] = values(name) if np.prod(ck.entry(name).shape) else np.zeros(ck.entry(name).shape, np.float32)
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"):
            os.remove(os.path.join(out_dir, f))
    # (save_file writes an array's buffer as it lies: a stack of transposed views would be written transposed)
    save_file({n: np.ascontiguousarray(a) for n, a in tensors.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    family = cfg["model_type"].removesuffix("_text")  # (Qwen3.5's text model: qwen3_5_moe_text)
    model_cls = getattr(transformers, CLASSES[family][1])
    return model_cls.from_pretrained(str(out_dir), torch_dtype=torch.float32, **REFERENCE).eval()
