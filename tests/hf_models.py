"""Tiny random checkpoints of every family, built with transformers' own classes.

Every parameter is re-drawn from a seeded generator (norm weights around 1, biases and
matrices with a std large enough that logits and router scores are well separated),
so a bug that ignores a norm, a bias or a gate changes the output.
"""

import json
import os
from pathlib import Path

import torch

# family -> [(case name, config kwargs)]; each case turns on options of the family
CASES = {
    "mixtral": [
        ("basic", dict(vocab_size=101, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2)),
        ("odd_tied_window", dict(vocab_size=77, hidden_size=36, intermediate_size=26, num_hidden_layers=3,
                                 num_attention_heads=3, num_key_value_heads=1, head_dim=20, num_local_experts=5,
                                 num_experts_per_tok=3, tie_word_embeddings=True, sliding_window=9,
                                 rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
    ],
    "qwen2_moe": [
        ("basic", dict(vocab_size=101, hidden_size=48, intermediate_size=40, moe_intermediate_size=24,
                       shared_expert_intermediate_size=36, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)),
        ("sparse_step_tied_window", dict(vocab_size=83, hidden_size=40, intermediate_size=30,
                                         moe_intermediate_size=14, shared_expert_intermediate_size=22,
                                         num_hidden_layers=5, num_attention_heads=5, num_key_value_heads=5,
                                         num_experts=7, num_experts_per_tok=3, norm_topk_prob=True,
                                         decoder_sparse_step=2, mlp_only_layers=[3], tie_word_embeddings=True, qkv_bias=False,
                                         use_sliding_window=True, sliding_window=7, max_window_layers=3)),
    ],
    "qwen3_moe": [
        ("basic", dict(vocab_size=101, hidden_size=48, intermediate_size=40, moe_intermediate_size=24,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
        ("dense_layer_tied_bias_yarn", dict(vocab_size=91, hidden_size=44, intermediate_size=34,
                                            moe_intermediate_size=18, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=1, head_dim=10,
                                            num_experts=9, num_experts_per_tok=4, norm_topk_prob=True,
                                            mlp_only_layers=[1], tie_word_embeddings=True, attention_bias=True,
                                            max_position_embeddings=256,
                                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                             "factor": 4.0, "original_max_position_embeddings": 64})),
        ("sparse_step_linear_rope_window", dict(vocab_size=64, hidden_size=32, intermediate_size=24,
                                                moe_intermediate_size=12, num_hidden_layers=4,
                                                num_attention_heads=2, num_key_value_heads=2, num_experts=5,
                                                num_experts_per_tok=1, decoder_sparse_step=2,
                                                use_sliding_window=True, sliding_window=6,
                                                rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                                                 "factor": 2.0})),
    ],
    "olmoe": [
        ("basic", dict(vocab_size=101, hidden_size=48, intermediate_size=20, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=False)),
        ("gqa_clip_tied_bias", dict(vocab_size=79, hidden_size=36, intermediate_size=18, num_hidden_layers=3,
                                    num_attention_heads=6, num_key_value_heads=3, num_experts=7,
                                    num_experts_per_tok=3, norm_topk_prob=True, clip_qkv=0.6,
                                    tie_word_embeddings=True, attention_bias=True)),
    ],
    "deepseek_v3": [
        ("q_lora_groups_interleaved", dict(vocab_size=101, hidden_size=48, intermediate_size=40,
                                           moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                                           num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                                           n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                                           kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=12,
                                           v_head_dim=10, rope_interleave=True, norm_topk_prob=True,
                                           routed_scaling_factor=2.5)),
        ("no_q_lora_yarn_bias_odd", dict(vocab_size=83, hidden_size=44, intermediate_size=30,
                                         moe_intermediate_size=18, num_hidden_layers=3, num_attention_heads=3,
                                         num_key_value_heads=3, n_routed_experts=9, num_experts_per_tok=3,
                                         n_group=3, topk_group=2, first_k_dense_replace=0, n_shared_experts=2,
                                         kv_lora_rank=14, q_lora_rank=None, qk_rope_head_dim=6, qk_nope_head_dim=10,
                                         v_head_dim=14, rope_interleave=False, norm_topk_prob=False,
                                         routed_scaling_factor=1.5, attention_bias=True, max_position_embeddings=256,
                                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                          "original_max_position_embeddings": 64, "mscale": 0.7,
                                                          "mscale_all_dim": 1.0})),
        ("one_group_two_dense_tied", dict(vocab_size=64, hidden_size=32, intermediate_size=24,
                                          moe_intermediate_size=12, num_hidden_layers=4, num_attention_heads=2,
                                          num_key_value_heads=2, n_routed_experts=5, num_experts_per_tok=2,
                                          n_group=1, topk_group=1, first_k_dense_replace=2, n_shared_experts=0,
                                          kv_lora_rank=8, q_lora_rank=6, qk_rope_head_dim=4, qk_nope_head_dim=8,
                                          v_head_dim=8, norm_topk_prob=True, tie_word_embeddings=True)),
    ],
    "glm4_moe": [
        ("partial_rotary_qk_norm_groups", dict(vocab_size=101, hidden_size=48, intermediate_size=40,
                                               moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=16, n_routed_experts=8,
                                               num_experts_per_tok=2, n_group=2, topk_group=1,
                                               first_k_dense_replace=1, n_shared_experts=1, use_qk_norm=True,
                                               attention_bias=True, routed_scaling_factor=2.5,
                                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                "partial_rotary_factor": 0.5})),
        ("odd_no_norm_two_shared", dict(vocab_size=83, hidden_size=44, intermediate_size=30,
                                        moe_intermediate_size=18, num_hidden_layers=3, num_attention_heads=4,
                                        num_key_value_heads=1, head_dim=12, n_routed_experts=9, num_experts_per_tok=3,
                                        n_group=3, topk_group=2, first_k_dense_replace=0, n_shared_experts=2,
                                        norm_topk_prob=False, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.75})),
    ],
    "minimax_m2": [
        ("rotary_dim_half", dict(vocab_size=101, hidden_size=48, intermediate_size=24, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                                 num_experts_per_tok=2, rotary_dim=8)),
        ("odd_full_rotary_tied", dict(vocab_size=83, hidden_size=44, intermediate_size=18, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=3, head_dim=10, num_local_experts=7,
                                      num_experts_per_tok=3, rotary_dim=10, tie_word_embeddings=True)),
    ],
    # index_topk below the tests' contexts, so the indexer's choice is reached; enough index
    # heads that no two tokens tie on an all-zero (relu) index score at the choice's edge
    "glm_moe_dsa": [
        ("full_shared_topk4", dict(vocab_size=101, hidden_size=48, intermediate_size=40, moe_intermediate_size=24,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                   n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
                                   kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=12,
                                   v_head_dim=10, index_topk=4, index_head_dim=16, index_n_heads=16,
                                   indexer_types=["full", "shared", "full"], n_group=2, topk_group=1)),
        ("odd_topk7_yarn", dict(vocab_size=83, hidden_size=44, intermediate_size=30, moe_intermediate_size=18,
                                num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3, n_routed_experts=9,
                                num_experts_per_tok=3, first_k_dense_replace=0, n_shared_experts=2, kv_lora_rank=14,
                                q_lora_rank=10, qk_rope_head_dim=6, qk_nope_head_dim=10, v_head_dim=14,
                                index_topk=7, index_head_dim=12, index_n_heads=16, max_position_embeddings=256,
                                indexer_types=["full", "full", "shared"], attention_bias=True,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 64, "mscale": 0.7,
                                                 "mscale_all_dim": 1.0})),
    ],
    "deepseek_v32": [  # every layer its own indexer, rotated by halves
        ("topk4_dense_first", dict(vocab_size=101, hidden_size=48, intermediate_size=40, moe_intermediate_size=24,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                   n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
                                   kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=12,
                                   v_head_dim=10, index_topk=4, index_head_dim=16, index_n_heads=16, n_group=2,
                                   topk_group=1)),
        ("odd_topk7_yarn_mlp_types", dict(vocab_size=83, hidden_size=44, intermediate_size=30, moe_intermediate_size=18,
                                          num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                                          n_routed_experts=9, num_experts_per_tok=3, n_shared_experts=2,
                                          kv_lora_rank=14, q_lora_rank=10, qk_rope_head_dim=6, qk_nope_head_dim=10,
                                          v_head_dim=14, index_topk=7, index_head_dim=12, index_n_heads=16,
                                          max_position_embeddings=256, mlp_layer_types=["sparse", "dense", "sparse"],
                                          n_group=3, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.5,
                                          tie_word_embeddings=True,
                                          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                           "original_max_position_embeddings": 64, "mscale": 0.7,
                                                           "mscale_all_dim": 1.0})),
    ],
    "deepseek_v4": [  # past the window, past index_topk entries, several windows of each rate
        ("all_types_hash_first", dict(vocab_size=101, hidden_size=48, moe_intermediate_size=24, num_hidden_layers=4,
                                      num_attention_heads=4, head_dim=16, q_lora_rank=12, n_routed_experts=6,
                                      num_experts_per_tok=2, hc_mult=2, sliding_window=5, o_groups=2, o_lora_rank=8,
                                      index_n_heads=8, index_head_dim=12, index_topk=3, partial_rotary_factor=0.5,
                                      layer_types=["sliding_attention", "compressed_sparse_attention",
                                                   "heavily_compressed_attention", "compressed_sparse_attention"],
                                      compress_rates={"compressed_sparse_attention": 3,
                                                      "heavily_compressed_attention": 5},
                                      mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], swiglu_limit=0.5)),
        ("odd_sigmoid_hc3_yarn", dict(vocab_size=83, hidden_size=44, moe_intermediate_size=18, num_hidden_layers=3,
                                      num_attention_heads=3, head_dim=12, q_lora_rank=10, n_routed_experts=7,
                                      num_experts_per_tok=3, hc_mult=3, hc_sinkhorn_iters=5, sliding_window=7,
                                      o_groups=3, o_lora_rank=6, index_n_heads=8, index_head_dim=10, index_topk=4,
                                      partial_rotary_factor=0.5, scoring_func="sigmoid", routed_scaling_factor=2.0,
                                      tie_word_embeddings=True, max_position_embeddings=256, compress_rope_theta=40000.0,
                                      layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                                   "sliding_attention"],
                                      compress_rates={"compressed_sparse_attention": 4,
                                                      "heavily_compressed_attention": 6},
                                      mlp_layer_types=["moe", "hash_moe", "moe"],
                                      rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 64})),
        ("hc1_legacy_spellings", dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                                    num_attention_heads=2, head_dim=16, q_lora_rank=8, n_routed_experts=5,
                                    num_experts_per_tok=2, hc_mult=1, sliding_window=3, o_groups=1, o_lora_rank=12,
                                    index_n_heads=8, index_head_dim=8, index_topk=2, qk_rope_head_dim=8,
                                    compress_ratios=[4, 0], num_hash_layers=1)),
    ],
    "inkling2": [  # past the window and the relative extent, blocks of two layers, log scaling from position 3
        ("sliding_full_blocks", dict(vocab_size=101, unpadded_vocab_size=97, hidden_size=32, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=16,
                                     sliding_window_size=5, d_rel=4, rel_extent=7, log_scaling_n_floor=3,
                                     n_layers_per_attn_res_block=2, moe_intermediate_size=16, n_routed_experts=5,
                                     num_experts_per_tok=2, conv_kernel_size=3,
                                     layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"])),
        ("full_first_sqrtsoftplus_capped", dict(vocab_size=64, unpadded_vocab_size=64, hidden_size=24, num_hidden_layers=3, num_attention_heads=3,
                                            num_key_value_heads=1, head_dim=8, swa_num_attention_heads=4,
                                            swa_num_key_value_heads=2, swa_head_dim=6, sliding_window_size=3,
                                            d_rel=3, rel_extent=4, log_scaling_n_floor=5, log_scaling_alpha=0.5,
                                            n_layers_per_attn_res_block=6, moe_intermediate_size=12,
                                            n_routed_experts=4, num_experts_per_tok=3, conv_kernel_size=4,
                                            scoring_func="sqrtsoftplus", route_scale=2.0, mlp_gate_softcap=1.0,
                                            mlp_up_softcap=2.0, final_logit_softcapping=5.0,
                                            qk_l2_clip_threshold=1.5, rel_l2_clip_threshold=0.5,
                                            layer_types=["hybrid", "hybrid_sliding", "hybrid_sliding"])),
    ],
    "glm5_next": [  # pools of 2 (topk 4: two of them) past the prompt's first pools, a shared indexer, 2 streams;
        # (16 indexer heads: with fewer, pools whose every head is ReLU 0 tie, often at the top when other
        # pools score below 0, and torch's topk breaks ties its own way)
        ("kda_pools_shared_hc2", dict(vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                      num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2,
                                      n_routed_experts=5, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=12,
                                      qk_nope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=16,
                                      index_kpool=2, linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=3,
                                      hc_mult=2, swiglu_limit=0.5,
                                      layer_types=["linear_attention", "indexed_attention", "indexed_attention",
                                                   "linear_attention", "indexed_attention"],
                                      indexer_types=["full", "full", "shared", "full", "full"],
                                      mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"])),
        ("one_stream_groups_no_bound", dict(vocab_size=64, hidden_size=32, intermediate_size=40,
                                            moe_intermediate_size=12, num_hidden_layers=3, num_attention_heads=3,
                                            num_key_value_heads=3, n_routed_experts=6, num_experts_per_tok=2, n_group=2,
                                            topk_group=1, n_shared_experts=2, kv_lora_rank=12, q_lora_rank=10,
                                            qk_nope_head_dim=6, v_head_dim=4, index_topk=6, index_head_dim=6,
                                            index_n_heads=16, index_kpool=3, linear_head_dim=6, linear_num_heads=3,
                                            linear_conv_kernel_dim=4, linear_lower_bound=None, hc_mult=1,
                                            hc_sinkhorn_iters=3, routed_scaling_factor=1.5,
                                            layer_types=["indexed_attention", "linear_attention", "indexed_attention"],
                                            indexer_types=["full", "full", "full"],
                                            mlp_layer_types=["sparse", "dense", "sparse"])),
    ],
    "qwen4_exp": [  # 2 streams, PLE on two layers (n-grams up to 3, eos 3 in the prompts), QSA blocks of 2
        ("ple_qsa_hc2", dict(vocab_size=101, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=3,
                             moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=5,
                             num_experts_per_tok=2, hc_count=2, hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=16,
                             ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
                             make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4, indexer_n_heads=16,
                             indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=2,
                             eos_token_id=3,
                             layer_types=["linear_attention", "indexed_attention", "linear_attention",
                                          "indexed_attention"],
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]})),
        ("hc3_sigmoid_gate_ngram4", dict(vocab_size=64, hidden_size=24, num_hidden_layers=3, num_attention_heads=3,
                                         num_key_value_heads=3, head_dim=8, linear_num_key_heads=1,
                                         linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=6,
                                         linear_conv_kernel_dim=4, moe_intermediate_size=12,
                                         shared_expert_intermediate_size=10, num_experts=6, num_experts_per_tok=3,
                                         norm_topk_prob=False, hc_count=3, hc_lowrank=5, ple_layer_ids=[2],
                                         ple_embed_dim=12, ple_conv_kernel_size=2, ngram_size=4, heads_per_ngram=2,
                                         ngram_vocab_size_base=40, make_ngram_vocab_size_divisible_by=16,
                                         split_ngram_parts=3, indexer_n_heads=16, indexer_kv_heads=1,
                                         indexer_head_dim=8, indexer_budget=6, indexer_compress_ratio=3,
                                         output_gate_type="sigmoid", eos_token_id=[5, 6], tie_word_embeddings=True,
                                         layer_types=["indexed_attention", "linear_attention", "indexed_attention"],
                                         rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                          "partial_rotary_factor": 1.0,
                                                          "mrope_section": [2, 1, 1]})),
    ],
    "gpt_oss": [
        ("sinks_sliding_clamped", dict(vocab_size=101, hidden_size=48, intermediate_size=24, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                                       num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.4)),
        ("odd_full_and_sliding_tied", dict(vocab_size=83, hidden_size=44, intermediate_size=18, num_hidden_layers=3,
                                           num_attention_heads=6, num_key_value_heads=3, head_dim=10,
                                           num_local_experts=7, num_experts_per_tok=3, sliding_window=6,
                                           layer_types=["full_attention", "sliding_attention", "full_attention"],
                                           tie_word_embeddings=True, max_position_embeddings=4096,
                                           rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                                            "factor": 8.0, "original_max_position_embeddings": 512,
                                                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})),
    ],
    # hybrids: Gated DeltaNet layers beside full attention; value heads a multiple of key heads
    "qwen3_next": [
        ("basic_three_to_one", dict(vocab_size=101, hidden_size=48, intermediate_size=40, moe_intermediate_size=24,
                                    shared_expert_intermediate_size=20, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
                                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                    linear_value_head_dim=6, linear_conv_kernel_dim=4)),
        ("odd_mix_sparse_tied", dict(vocab_size=83, hidden_size=44, intermediate_size=30, moe_intermediate_size=18,
                                     shared_expert_intermediate_size=14, num_hidden_layers=5, num_attention_heads=3,
                                     num_key_value_heads=1, head_dim=12, num_experts=7, num_experts_per_tok=3,
                                     norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3],
                                     layer_types=["full_attention", "linear_attention", "linear_attention",
                                                  "full_attention", "linear_attention"],
                                     linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=10,
                                     linear_value_head_dim=7, linear_conv_kernel_dim=3, tie_word_embeddings=True,
                                     rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                                      "partial_rotary_factor": 0.5})),
    ],
    "qwen3_5_moe": [
        ("basic_three_to_one", dict(vocab_size=101, hidden_size=48, moe_intermediate_size=24,
                                    shared_expert_intermediate_size=20, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
                                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                    linear_value_head_dim=6, linear_conv_kernel_dim=4)),
        ("odd_mix_tied", dict(vocab_size=83, hidden_size=44, moe_intermediate_size=18, shared_expert_intermediate_size=14,
                              num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, head_dim=12,
                              num_experts=7, num_experts_per_tok=3,
                              layer_types=["linear_attention", "full_attention", "linear_attention"],
                              linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=10,
                              linear_value_head_dim=9, linear_conv_kernel_dim=2, tie_word_embeddings=True)),
    ],
    "kimi_linear": [
        ("q_lora_groups_mixed", dict(vocab_size=101, hidden_size=48, intermediate_size=40, moe_intermediate_size=24,
                                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                     n_shared_experts=1, kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8,
                                     qk_nope_head_dim=12, v_head_dim=10, n_group=2, topk_group=1,
                                     num_experts_per_tok=2, num_local_experts=8, linear_head_dim=8,
                                     linear_num_heads=3, linear_conv_kernel_dim=4,
                                     layer_types=["linear_attention", "full_attention", "linear_attention",
                                                  "full_attention"],
                                     mlp_layer_types=["sparse", "dense", "sparse", "sparse"])),
        ("odd_no_q_lora_two_shared", dict(vocab_size=83, hidden_size=44, intermediate_size=30, moe_intermediate_size=18,
                                          num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                                          n_shared_experts=2, kv_lora_rank=14, q_lora_rank=None, qk_rope_head_dim=6,
                                          qk_nope_head_dim=10, v_head_dim=14, n_group=1, topk_group=1,
                                          num_experts_per_tok=3, num_local_experts=9, norm_topk_prob=False,
                                          routed_scaling_factor=1.5, linear_head_dim=10, linear_num_heads=2,
                                          linear_conv_kernel_dim=3, tie_word_embeddings=True,
                                          layer_types=["full_attention", "linear_attention", "linear_attention"],
                                          mlp_layer_types=["dense", "sparse", "sparse"])),
    ],
}

CLASSES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM"),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
    "inkling2": ("Inkling2TextConfig", "Inkling2ForCausalLM"),
    "glm5_next": ("Glm5NextConfig", "Glm5NextForConditionalGeneration"),
    "qwen4_exp": ("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM"),
}

def logits_atol(family: str) -> float:
    """How far our float32 logits may be from transformers' on a tiny checkpoint: 1e-4;
    2e-4 for the Gated DeltaNet families, whose linear layers transformers computes in chunks
    of 64 (another order of the same sums) and we token by token: measured up to 1.4e-4 on
    an AVX2-only host (AMD EPYC, 2026-12-07), within 1e-4 on AVX-512 ones. Greedy tokens are
    compared exactly in every case."""
    return 2e-4 if family in ("qwen3_next", "qwen3_5_moe", "qwen4_exp") else 1e-4


ALL_CASES = [(fam, name) for fam, cases in CASES.items() for name, _ in cases]


def build(family: str, case: str, path: str, seed: int = 0, dtype=torch.float32, vision: dict | None = None,
          **overrides):
    """Create, randomise and save a model; return the transformers model (float32, eval).
    An image-text-only family's vision tower: VISION's, or `vision`."""
    import transformers

    kwargs = dict(dict(CASES[family])[case])
    kwargs.update(overrides)
    kwargs.setdefault("eos_token_id", None)
    kwargs.setdefault("bos_token_id", None)
    kwargs.setdefault("pad_token_id", None)
    cfg_cls, model_cls = (getattr(transformers, n) for n in CLASSES[family])
    if family in VISION:  # an image-text model only: the text model's config inside, a tiny vision tower
        kwargs = dict(text_config=kwargs,
                      vision_config=(vision or VISION[family]) | {"out_hidden_size": kwargs["hidden_size"]})
    torch.manual_seed(seed)
    # the plain loop-over-experts and eager attention: the reference code path
    model = model_cls(cfg_cls(**kwargs, experts_implementation="eager", attn_implementation="eager")).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():  # a router's selection-only bias is a buffer
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
            elif name.endswith("tid2eid"):  # DeepSeek-V4's hash layers: distinct experts per token id
                b.copy_(torch.stack([torch.randperm(model.config.n_routed_experts, generator=gen)[: b.shape[1]]
                                     for _ in range(b.shape[0])]))
    model.to(dtype).save_pretrained(path)
    return model.float()


REFERENCE = dict(experts_implementation="eager", attn_implementation="eager")
# families transformers has as image-text models only: the tests build them with this vision
# tower (never read by colibri)
VISION = {"glm5_next": dict(depth=1, hidden_size=32, num_heads=2, projection_intermediate_size=32, patch_size=2,
                            image_size=4, spatial_merge_size=1)}


def rewrite_config(path: str, fn) -> None:
    """Apply fn to config.json in place (to spell it another way, or break it)."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    out = fn(cfg)
    cfg = out if isinstance(out, dict) else cfg
    with open(file, "w") as f:
        json.dump(cfg, f, indent=1)


def hub_spelling(cfg: dict) -> dict:
    """Rewrite a transformers-5 config the way hub checkpoints spell it: top-level rope_theta
    (+ rope_scaling), and the other name of the expert count."""
    params = cfg.pop("rope_parameters", None) or {}
    if isinstance(params.get("compress"), dict):  # DeepSeek-V4: its compressed layers' YaRN as rope_scaling,
        comp = dict(params["compress"])  # the bases top-level, the rotary part as the older qk_rope_head_dim
        cfg["rope_theta"], cfg["compress_rope_theta"] = params["main"]["rope_theta"], comp.pop("rope_theta")
        cfg["qk_rope_head_dim"] = int(cfg["head_dim"] * comp.pop("partial_rotary_factor"))
        cfg.pop("partial_rotary_factor", None)
        if comp.get("rope_type", "default") != "default":
            comp.pop("attention_factor", None)
            cfg["rope_scaling"] = {"type": comp.pop("rope_type"), **comp}
        params = {}
    cfg["rope_theta"] = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in params:  # GLM-4.5's hub config: at the top level
        cfg["partial_rotary_factor"] = params.pop("partial_rotary_factor")
    if params.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    for a, b in (("num_local_experts", "num_experts"), ("num_experts", "num_local_experts")):
        if a in cfg:
            cfg[b] = cfg.pop(a)
            break
    return cfg


def build_container(root, family: str, case: str, seed: int, convert_kw: dict | None = None, **overrides):
    """A tiny checkpoint built in root/hf and converted into the container root/c (with
    convert's `convert_kw`: expert_dtype, group_size, ...); returns it opened."""
    from colibri.engine.registry import build_model
    from colibri.storage.checkpoint import load_config, open_checkpoint
    from colibri.storage.container import open_container
    from colibri.storage.convert import convert, plan_for

    build(family, case, root / "hf", seed=seed, **overrides)
    model = build_model(str(root / "hf"), load_config(str(root / "hf")))
    convert(model.source(open_checkpoint(str(root / "hf"))), root / "c",
            plan_for(model), **(convert_kw or {}))
    return open_container(str(root / "c"))


def flip(path, offset):
    """Flip one bit of the byte at `offset` of the file: a damaged drive or copy."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def served(cache, il, ids):
    """What an expert source hands out for experts `ids` of layer il, copied: {id: [arrays]}."""
    import numpy as np

    return {ie: [np.array(a, copy=True) for a in w] for batch in cache.stream(il, ids) for ie, w in batch}


def load_model(path, **placement):
    """The model at `path` placed as `placement` says (storage.placement.Placement's
    fields), the way colictl run and the daemon place it."""
    from colibri.engine.registry import build_model
    from colibri.storage.placement import Placement, open_model

    return open_model(str(path), Placement(**placement), build_model).model


# ---- the published precisions: FP8 block-scaled, MXFP4 ---------------------------------------
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
NOT_FP8 = ("embed_tokens", "lm_head", ".gate.weight", "norm",  # kept in bf16 by the FP8 releases (routers: `*.gate`)
           "ngram_embedding")  # (Qwen4-Exp's n-gram tables: embeddings too)


def _fp8_quantize(w: torch.Tensor, block: tuple[int, int] | None, fmt: str, power_of_two: bool = False):
    # w [N, K] f32 -> (codes as torch float8 [N, K], scales f32 [ceil(N/bn), ceil(K/bk)]): the
    # way DeepSeek's checkpoints are made (each block's max magnitude to the format's largest)
    n, k = w.shape
    bn, bk = block or (n, k)
    nb, kb = -(-n // bn), -(-k // bk)
    pad = torch.zeros(nb * bn, kb * bk)
    pad[:n, :k] = w
    amax = pad.reshape(nb, bn, kb, bk).abs().amax(dim=(1, 3)).clamp(min=1e-8)  # [nb, kb]
    scale = (amax / FP8_MAX[fmt]).float()
    if power_of_two:  # e8m0 scales (DeepSeek-V4's ue8m0): the power of two at or above
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    return (w / full).to(dtype), scale


def _fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    n, k = q.shape
    bn, bk = block or (n, k)
    return q.float() * scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]


def _rewrite_weights(path, fn, family: str) -> "torch.nn.Module":
    # every safetensors file of the checkpoint: {name: tensor} -> fn -> (the file's new
    # tensors, the values they stand for in float32, by name); the first written back, the
    # second into a float32 copy of the checkpoint beside it, which transformers loads as
    # the reference (its own name mapping puts per-expert tensors into fused parameters)
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    ref_dir = f"{path}.reference"
    shutil.copytree(path, ref_dir)
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(path, f))
            stored, values = fn(tensors)
            save_file(stored, os.path.join(path, f), metadata={"format": "pt"})
            save_file({n: values.get(n, t).contiguous() for n, t in tensors.items()}, os.path.join(ref_dir, f),
                      metadata={"format": "pt"})
    model_cls = getattr(transformers, CLASSES[family][1])
    return model_cls.from_pretrained(ref_dir, torch_dtype=torch.float32, **REFERENCE).eval()


def build_fp8(family: str, case: str, path, seed: int = 0, block=(16, 16), fmt: str = "e4m3", keep=(),
              **overrides):
    """A checkpoint as the FP8 releases lay it out: every projection matrix (attention,
    MLPs, experts; not the embeddings, the lm_head or the router, nor the modules named in
    `keep`, which go to `modules_to_not_convert` as Qwen's releases list their small
    projections) as float8 codes with `weight_scale_inv` per block, `quantization_config` in
    config.json. Returns the transformers model holding the same values dequantized to
    float32: the reference."""
    build(family, case, path, seed=seed, **overrides)
    left = NOT_FP8 + tuple(f".{k}.weight" for k in keep)

    def quantize(tensors):
        out, values = {}, {}
        for name, t in tensors.items():
            if t.ndim == 2 and name.endswith(".weight") and not any(k in name for k in left):
                q, s = _fp8_quantize(t.float(), block, fmt)
                out[name], out[name + "_scale_inv"] = q, s
                values[name] = _fp8_dequantize(q, s, block)
            else:
                out[name] = t
        assert values, "no matrix was quantized"
        return out, values

    ref = _rewrite_weights(path, quantize, family)
    cfg = {"quant_method": "fp8", "fmt": fmt, "activation_scheme": "dynamic"}
    if keep:
        cfg["modules_to_not_convert"] = ["lm_head", "model.embed_tokens", *keep]
    if block is not None:
        cfg["weight_block_size"] = list(block)
    rewrite_config(path, lambda c: c.update(quantization_config=cfg))
    return ref


def build_mxfp8(family: str, case: str, path, seed: int = 0, **overrides):
    """A checkpoint as Inkling-2's MXFP8 release lays it out: every projection matrix
    (not the embeddings, the output head, the router, norms or convolutions) and the stacked
    experts as float8 e4m3 codes with an e8m0 scale byte per 32 values of a row
    (`X.weight_scale_inv`, the experts' `w13_weight_scale`), quant_method mxfp8. Returns the
    transformers model with the same values dequantized to float32."""
    build(family, case, path, seed=seed, **overrides)

    def e8m0(t):  # [..., N, K] -> codes, scale bytes [..., N, K/32], values
        *lead, n, k = t.shape
        flat = t.float().reshape(-1, k)
        q, sc = _fp8_quantize(flat, (1, 32), "e4m3", power_of_two=True)
        values = _fp8_dequantize(q, sc, (1, 32)).reshape(t.shape)
        return q.reshape(t.shape), (torch.log2(sc) + 127).to(torch.uint8).reshape(*lead, n, k // 32), values

    def quantize(tensors):
        out, values = {}, {}
        for name, t in tensors.items():
            if name.endswith(("experts.w13_weight", "experts.w2_weight")):
                out[name], out[name + "_scale"], values[name] = e8m0(t)
            elif t.ndim == 2 and name.endswith(".weight") and t.shape[1] % 32 == 0 and not name.endswith(
                    ("embed.weight", "unembed.weight", "gate.weight", "norm.weight")):
                out[name], out[name + "_scale_inv"], values[name] = e8m0(t)
            else:
                out[name] = t
        return out, values

    ref = _rewrite_weights(path, quantize, family)
    rewrite_config(path, lambda c: c.update(quantization_config={
        "quant_method": "mxfp8", "fmt": "e4m3", "weight_block_size": [1, 32], "scale_fmt": "ue8m0",
        "activation_scheme": "dynamic"}))
    return ref


E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _mxfp4_quantize(w: torch.Tensor):
    # w [..., N, K] f32 -> blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32] and the
    # values they stand for [..., N, K]: per 32 values the power of two that puts the largest
    # at or below 6, each value to the nearest e2m1 code
    *lead, n, k = w.shape
    g = w.reshape(*lead, n, k // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0 ** -100)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.pow(2.0, e)[..., None]
    codes = (scaled[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    values = E2M1[codes.long()] * torch.pow(2.0, e)[..., None]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (e + 127).to(torch.uint8), values.reshape(*lead, n, k)


def build_mxfp4(family: str, case: str, path, seed: int = 0, **overrides):
    """A gpt-oss checkpoint as the MXFP4 release lays it out: the fused expert matrices as
    `*_blocks` / `*_scales` ([out, in]), quant_method mxfp4. Returns the transformers model
    with the same values dequantized to float32."""
    build(family, case, path, seed=seed, **overrides)

    def quantize(tensors):
        out, values = {}, {}
        for name, t in tensors.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales, v = _mxfp4_quantize(t.float().transpose(1, 2))  # [E, out, in]
                out[name + "_blocks"], out[name + "_scales"] = blocks, scales
                values[name] = v.transpose(1, 2)
            else:
                out[name] = t
        assert values, "no expert matrix was quantized"
        return out, values

    ref = _rewrite_weights(path, quantize, family)
    rewrite_config(path, lambda c: c.update(quantization_config={"quant_method": "mxfp4"}))
    return ref


def build_fp4(family: str, case: str, path, seed: int = 0, block=(16, 16), hub_names: bool = False, **overrides):
    """A DeepSeek-V4 checkpoint as its release lays it out: the routed experts FP4 (I8, two
    e2m1 codes a byte, an e8m0 scale per 32 of a row), the other matrices FP8 e4m3 in
    `block`s with e8m0 (power-of-two) scales (`scale_fmt: ue8m0`), the compressors' and the
    indexer's projections, the routers and the embeddings left as they are; hub_names: the
    scales named `X.scale` as DeepSeek names them. Returns the transformers model holding
    the same values in float32."""
    build(family, case, path, seed=seed, **overrides)
    keep = ("compressor.", "indexer.weights_proj", "embed", "head.weight", ".gate.weight", "norm")

    def quantize(tensors):
        out, values = {}, {}
        for name, t in tensors.items():
            scale_as = name.removesuffix(".weight") + ".scale" if hub_names else name + "_scale_inv"
            if t.ndim == 2 and ".experts." in name and name.endswith(".weight"):
                blocks, scales, v = _mxfp4_quantize(t.float())
                out[name] = blocks.reshape(t.shape[0], -1).view(torch.int8)
                out[scale_as] = scales.view(torch.float8_e8m0fnu)
                values[name] = v
            elif t.ndim == 2 and name.endswith(".weight") and not any(k in name for k in keep):
                q, sc = _fp8_quantize(t.float(), block, "e4m3", power_of_two=True)
                out[name], out[scale_as] = q, sc.to(torch.float8_e8m0fnu)
                values[name] = _fp8_dequantize(q, sc, block)
            else:
                out[name] = t
        return out, values

    ref = _rewrite_weights(path, quantize, family)
    rewrite_config(path, lambda c: c.update(quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
        "scale_fmt": "ue8m0", "expert_dtype": "fp4"}))
    return ref


def image_text(cls: str, config, path, seed: int = 0):
    """An image-text model of transformers' class `cls` (config: its config instance), its
    weights random (norms about 1), saved at `path`; returns it (float32, eval)."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, cls)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 if name.endswith("norm.weight") else 0) + 0.15 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    return model


def read_bytes() -> int:
    """Bytes this process has read through read/pread syscalls so far (the kernel's count):
    what loading an image-text checkpoint's text model may not spend on its vision tower."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def runs_its_text_model(ref, path, family: str, vision: str, min_vision: int, ids):
    """`ref`, transformers' image-text model saved at `path`: asserts colibri loads `path` as
    `family` reading less than a quarter of the vision tower's bytes (the parameters named
    with `vision`, more than `min_vision` of them) and gives ref's logits on the text `ids`
    within 1e-4; returns colibri's logits."""
    visual = sum(p.numel() * 4 for n, p in ref.named_parameters() if vision in n)
    assert visual > min_vision
    before = read_bytes()
    ours = load_model(str(path))
    assert ours.MODEL_TYPE == family and read_bytes() - before < visual // 4
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(ids)[None]).logits[0].numpy()
    got = ours.forward(ids, ours.new_cache(32), all_logits=True)
    assert got.shape == want.shape and abs(got - want).max() <= 1e-4
    return got


# ---- image-text checkpoints ------------------------------------------------------------------
K25_VISION = dict(patch_size=4, pos_emb_height=8, pos_emb_width=8, pos_emb_time=2, num_attention_heads=2,
              num_hidden_layers=2, hidden_size=256, intermediate_size=1024, merge_kernel_size=[2, 2])


def build_k25(path, case: str, tie: bool | None, seed: int = 0, **overrides):
    """A random Kimi K2.5-shaped image-text model (the text model one of deepseek_v3's
    cases, spelled `kimi_k2` as the hub does), saved by transformers; returns it (eval)."""
    import transformers

    text = dict(dict(CASES["deepseek_v3"])[case], model_type="kimi_k2", eos_token_id=None, bos_token_id=None,
                pad_token_id=None) | overrides
    extra = {} if tie is None else {"tie_word_embeddings": tie}
    torch.manual_seed(seed)
    ref = transformers.Kimi_K25ForConditionalGeneration(transformers.Kimi_K25Config(
        text_config=text, vision_config=K25_VISION, projection_hidden_size=K25_VISION["hidden_size"], **extra)).eval()
    ref.set_experts_implementation("eager")  # the reference code path (hf_models.build)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_((1 if name.endswith("norm.weight") else 0) + 0.15 * torch.randn(p.shape, generator=gen))
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    ref.save_pretrained(path)
    return ref


def k25_hub_names(path) -> None:
    """Rename the weights save_pretrained wrote the way the hub's checkpoint has them. Its
    renaming rules for the vision tower, reversed on saving, catch the text model too: its
    layers become `blocks` (and a text model without q_lora_rank would have its q_proj
    merged and permuted as the vision tower's wqkv: every Kimi K2.5 has q_lora_rank)."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({n.replace("language_model.model.blocks.", "language_model.model.layers."): t
                   for n, t in tensors.items()}, f, metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
