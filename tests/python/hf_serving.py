# SPDX-License-Identifier: Apache-2.0
"""A small engine over transformers MoE models, for the tests: what an
inference engine does around moecap, in miniature.

Each attention-DP rank is a thread with its own model replica and capturer;
the MoE layers see every rank's rows gathered back to back (an all-gather
over threads). A rank serves waves of requests as left-padded batches:
chunked prefill, then greedy decode with the model's KV cache. Every token it
forwards gets a KV slot drawn at random from the rank's free list (so
requests hold non-contiguous slots, and finished requests' slots are reused
by the next wave); padding and finished rows commit to slot -1. Each forward
also asks the model for output_router_logits, from which `reference` derives
the model's top-k: the expected routing of every token.
"""
import copy
import inspect
import threading

import numpy as np
import torch
import transformers

import moecap
from moecap import hf
from moecap.engine import RequestTable, batch_slots, commit_batch

VOCAB = 64
# transformers renamed past_key_values to cache (the old name is deprecated from 5.x).
CACHE_ARG = "past_key_values"


def tiny_config(model_type):
    """A random-weight config of each architecture: small, fast, no downloads.
    None if the installed transformers lacks the config class."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
                  bos_token_id=2, tie_word_embeddings=False)
    moe = dict(num_experts_per_tok=2)
    grouped = dict(n_routed_experts=8, moe_intermediate_size=16, n_shared_experts=1, n_group=2, topk_group=1,
                   first_k_dense_replace=1, routed_scaling_factor=2.5)  # a scale other than 1, so it is checked
    # for configs with no first_k_dense_replace (a field their class lacks would mislead the engine adapters)
    grouped_bare = {k: v for k, v in grouped.items() if k != "first_k_dense_replace"}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1)
    small_vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    specs = {
        "mixtral": ("MixtralConfig", dict(num_local_experts=8)),
        # dense layer 1 between MoE layers 0 and 2; a gated shared expert
        "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                             mlp_only_layers=[1])),
        "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, moe_intermediate_size=16, head_dim=16)),
        "olmoe": ("OlmoeConfig", dict(num_experts=8)),
        "granitemoe": ("GraniteMoeConfig", dict(num_local_experts=8)),
        "phimoe": ("PhimoeConfig", dict(num_local_experts=8)),
        # 8 experts in 2 groups, 1 group kept; dense first layer; a shared expert
        "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=8, moe_intermediate_size=16, n_shared_experts=1,
                                                 n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                                                 kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                                 num_key_value_heads=2)),
        "glm4_moe": ("Glm4MoeConfig", dict(grouped, head_dim=16)),
        "dots1": ("Dots1Config", dict(grouped, head_dim=16)),
        # softmax with group-limited greedy top-k (the group's best expert ranks the group)
        "deepseek_v2": ("DeepseekV2Config", dict(grouped, topk_method="group_limited_greedy", q_lora_rank=16,
                                                 kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                                 v_head_dim=8, num_key_value_heads=2)),
        # linear-attention layers around a full one; dense layer 1; a gated shared expert
        "qwen3_next": ("Qwen3NextConfig", dict(num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                               head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                                               linear_num_key_heads=2, linear_num_value_heads=2, mlp_only_layers=[1],
                                               layer_types=["linear_attention", "full_attention",
                                                            "linear_attention"])),
        "flex_olmo": ("FlexOlmoConfig", dict(num_experts=8)),
        "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(num_experts=8, moe_topk=2, head_dim=16)),
        "gpt_oss": ("GptOssConfig", dict(num_local_experts=8, head_dim=16, sliding_window=8)),
        "granitemoeshared": ("GraniteMoeSharedConfig", dict(num_local_experts=8, shared_intermediate_size=16)),
        # dense first layer; top-k of softmax plus a bias (moe_statics) picks, the softmax weighs
        "minimax_m2": ("MiniMaxM2Config", dict(num_local_experts=8, head_dim=16)),
        # no dense layers: Solar Open's config has no first_k_dense_replace
        "solar_open": ("SolarOpenConfig", dict(grouped_bare, head_dim=16)),
        "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=16,
                                                    moe_num_shared_experts=1, moe_layer_start_index=1,
                                                    moe_layer_interval=1)),
        # sigmoid of the top-k logits, not renormalized; a shared expert summed in; a dense first layer
        "cohere2_moe": ("Cohere2MoeConfig", dict(num_experts=8, head_dim=16, expert_selection_fn="sigmoid",
                                                 first_k_dense_replace=1, norm_topk_prob=False, num_shared_experts=1,
                                                 shared_expert_combination_strategy="sum", sliding_window=8)),
        # Mamba layers around an attention one, each with a MoE block
        "granitemoehybrid": ("GraniteMoeHybridConfig", dict(num_local_experts=8, shared_intermediate_size=16,
                                                            layer_types=["linear_attention", "attention",
                                                                         "linear_attention"],
                                                            mamba_n_heads=4, mamba_d_state=8, mamba_d_head=16,
                                                            mamba_chunk_size=4)),
        "granitemoe_swa": ("GraniteMoeSWAConfig", dict(num_local_experts=8, shared_intermediate_size=16,
                                                       sliding_window=4)),
        # MoE layers around an attention one; DeepSeek-V3's grouped top-k: 2 groups, 1 kept, a scale other than 1.
        "nemotron_h": ("NemotronHConfig", dict(n_routed_experts=8, moe_intermediate_size=16,
                                               moe_shared_expert_intermediate_size=16, n_group=2, topk_group=1,
                                               routed_scaling_factor=2.5, head_dim=16,
                                               layers_block_type=["moe", "full_attention", "moe"],
                                               mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1,
                                               chunk_size=4)),
        # a dense MLP beside every MoE block; the router's per-expert scale (randomized by build)
        "gemma4_text": ("Gemma4TextConfig", dict(enable_moe_block=True, num_experts=8, top_k_experts=2,
                                                 moe_intermediate_size=16, head_dim=16, global_head_dim=16,
                                                 hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                                                 sliding_window=8)),
        # the multimodal wrapper around gemma4_text's config, with a one-layer vision tower
        "gemma4": ("Gemma4Config", dict(text_config="gemma4_text", audio_config=None,
                                        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                                           num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                                           position_embedding_size=64))),
        # a hash-routed first MoE layer (fixed experts per token id, randomized by build), then top-k ones
        "deepseek_v4": ("DeepseekV4Config", dict(n_routed_experts=8, moe_intermediate_size=16, head_dim=16,
                                                 q_lora_rank=16, routed_scaling_factor=2.5,
                                                 mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=8,
                                                 o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
                                                 index_topk=4, hc_mult=2, num_nextn_predict_layers=0)),
        # MoE layers 0 and 2 around a dense one; top-1 as Scout and Maverick route
        "llama4_text": ("Llama4TextConfig", dict(num_local_experts=8, num_experts_per_tok=1, intermediate_size_mlp=32,
                                                 head_dim=16, moe_layers=[0, 2], attention_chunk_size=8)),
        "aria_text": ("AriaTextConfig", dict(moe_num_experts=8, moe_topk=2, moe_num_shared_experts=1, head_dim=16)),
        # linear-attention layers around a full one; every layer MoE with a gated shared expert
        "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(num_experts=8, moe_intermediate_size=16,
                                                          shared_expert_intermediate_size=16, head_dim=16,
                                                          linear_key_head_dim=8, linear_value_head_dim=8,
                                                          linear_num_key_heads=2, linear_num_value_heads=2,
                                                          layer_types=["linear_attention", "full_attention",
                                                                       "linear_attention"])),
        # served only inside its wrapper (no causal-LM class of its own); dense layer 1
        "qwen3_vl_moe_text": ("Qwen3VLMoeTextConfig", dict(num_experts=8, moe_intermediate_size=16, head_dim=16,
                                                           mlp_only_layers=[1])),
        # DeepSeek-V3's routing under sparse attention (a lightning indexer picks the keys)
        "deepseek_v32": ("DeepseekV32Config", dict(grouped, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                                   qk_nope_head_dim=8, v_head_dim=8, head_dim=8, num_key_value_heads=2,
                                                   index_topk=4, index_head_dim=16, index_n_heads=2)),
        # DeepSeek-V3's routing under MLA; its first layer dense by default
        "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(grouped_bare, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                                    qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=2)),
        # DeepSeek-V3's routing under MLA with a sparse-attention indexer
        "glm_moe_dsa": ("GlmMoeDsaConfig", dict(grouped, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                                qk_nope_head_dim=8, v_head_dim=8, head_dim=8, num_key_value_heads=2,
                                                index_topk=4, index_head_dim=16, index_n_heads=2)),
        # DeepSeek-V3's routing; Kimi delta attention layers around an MLA one. Its experts are num_local_experts;
        # first_k_dense_replace is a checkpoint key its config reads
        "kimi_linear": ("KimiLinearConfig", dict({k: v for k, v in grouped.items() if k != "n_routed_experts"},
                                                 num_local_experts=8, kv_lora_rank=16, qk_rope_head_dim=8,
                                                 qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=2,
                                                 linear_head_dim=8, linear_num_heads=2,
                                                 layer_types=["linear_attention", "full_attention",
                                                              "linear_attention"])),
        # grouped top-k of the softmax (no correction bias); dense first layer
        "mistral4": ("Mistral4Config", dict(grouped, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                            qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=2)),
        # served only inside its wrapper: DeepSeek-V3's routing; hyper-connections, linear-attention layers around
        # an indexed one; dense layer 0
        "glm5_next_text": ("Glm5NextTextConfig", dict(grouped_bare, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                                      v_head_dim=8, num_key_value_heads=2, index_topk=4,
                                                      index_kpool=2, index_head_dim=16, index_n_heads=2,
                                                      linear_head_dim=8,
                                                      linear_num_heads=2, mlp_layer_types=["dense", "sparse", "sparse"],
                                                      layer_types=["linear_attention", "full_attention",
                                                                   "linear_attention"])),
        # the Omni thinker's language model, served inside it; no renormalization; dense layer 1
        "qwen3_omni_moe_text": ("Qwen3OmniMoeTextConfig", dict(num_experts=8, moe_intermediate_size=16, head_dim=16,
                                                               norm_topk_prob=False, mlp_only_layers=[1])),
        # linear-attention layers, then an indexed one: hyper-connections; gated shared expert; no renormalization.
        # The indexed layer comes last: its query rows of left padding select no key (NaN), which a linear-attention
        # layer after it would carry into the real tokens.
        "qwen4_exp_text": ("Qwen4ExpTextConfig", dict(num_experts=8, moe_intermediate_size=16,
                                                      shared_expert_intermediate_size=16, head_dim=16,
                                                      linear_key_head_dim=8, linear_value_head_dim=8,
                                                      linear_num_key_heads=2, linear_num_value_heads=2, hc_lowrank=8,
                                                      indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                                                      indexer_budget=4, indexer_compress_ratio=2, norm_topk_prob=False,
                                                      layer_types=["linear_attention", "linear_attention",
                                                                   "full_attention"])),
        # served only inside its wrapper: DeepSeek-V2's softmax, group-limited greedy top-k; dense first layer
        "deepseek_ocr2_text": ("DeepseekOcr2TextConfig", dict(grouped_bare, topk_method="group_limited_greedy",
                                                              mlp_layer_types=["dense", "sparse", "sparse"])),
        # served only inside its wrapper: GLM-4.5's routing; M-RoPE sections that fit the tiny rotary half (4)
        "glm4v_moe_text": ("Glm4vMoeTextConfig", dict(grouped, head_dim=16, rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 1, 1]))),
        # multimodal wrappers around those text configs, each with a one-block vision tower
        "qwen3_5_moe": ("Qwen3_5MoeConfig", dict(text_config="qwen3_5_moe_text", vision_config=vision)),
        "qwen3_vl_moe": ("Qwen3VLMoeConfig", dict(text_config="qwen3_vl_moe_text", vision_config=vision)),
        "qwen4_exp": ("Qwen4ExpConfig", dict(text_config="qwen4_exp_text", vision_config=vision)),
        "glm4v_moe": ("Glm4vMoeConfig", dict(text_config="glm4v_moe_text", vision_config=vision)),
        "llama4": ("Llama4Config", dict(text_config="llama4_text", vision_config=dict(
            hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
            patch_size=8, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32))),
        "glm5_next": ("Glm5NextConfig", dict(text_config="glm5_next_text",
                                             vision_config=dict(vision, projection_intermediate_size=32))),
        "deepseek_ocr2": ("DeepseekOcr2Config", dict(text_config="deepseek_ocr2_text", vision_config=dict(
            sam_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=1, num_attention_heads=2,
                            image_size=64, patch_size=16, global_attn_indexes=[0], downsample_channels=[16, 32]),
            encoder_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1)))),
        "qwen3_omni_moe_thinker": ("Qwen3OmniMoeThinkerConfig", dict(
            text_config="qwen3_omni_moe_text", vision_config=dict(vision, deepstack_visual_indexes=[0]),
            audio_config=dict(encoder_layers=1, encoder_attention_heads=2, d_model=32, encoder_ffn_dim=32,
                              output_dim=32, downsample_hidden_size=8))),
        # a lightning (linear) attention layer between full ones (the default pattern: MiniMaxCache counts the
        # tokens seen in layer 0's keys), block_size 4 so prefill crosses blocks
        "minimax": ("MiniMaxConfig", dict(num_local_experts=8, head_dim=16, block_size=4)),
        # dense first layer; a short-convolution layer; top-k of sigmoid + the block's expert bias, scaled
        "lfm2_moe": ("Lfm2MoeConfig", dict(num_experts=8, moe_intermediate_size=16, num_dense_layers=1,
                                           routed_scaling_factor=2.5,
                                           layer_types=["full_attention", "conv", "full_attention"])),
        "exaone_moe": ("ExaoneMoeConfig", dict(num_experts=8, moe_intermediate_size=16, n_group=2, topk_group=1,
                                               first_k_dense_replace=1, routed_scaling_factor=2.5, sliding_window=8,
                                               sliding_window_pattern=2)),
        # dense first layer; top-k of sigmoid + the block's expert bias, scaled by route_scale; shared experts
        "afmoe": ("AfmoeConfig", dict(num_experts=8, moe_intermediate_size=16, num_dense_layers=1, num_shared_experts=1,
                                      route_scale=2.5, head_dim=16, sliding_window=8, global_attn_every_n_layers=2)),
        # DeepSeek-V3's router without shared experts; dense first layer; sliding layers with sinks
        "mimo_v2_flash": ("MiMoV2FlashConfig", dict(n_routed_experts=8, moe_intermediate_size=16, n_group=2,
                                                    topk_group=1, routed_scaling_factor=2.5, head_dim=16,
                                                    v_head_dim=16, sliding_window=8)),
        # Step 3.7's language model (model_type step3p5, which no model class builds alone): top-k of sigmoid + the
        # router's correction bias; the block scales the routed sum by moe_router_scaling_factor, after the experts;
        # dense first layer; a shared expert
        "step3p5": ("Step3p7TextConfig", dict(n_routed_experts=8, moe_intermediate_size=16, share_expert_dim=16,
                                              head_dim=16, mlp_layer_types=["dense", "sparse", "sparse"],
                                              moe_router_scaling_factor=2.5, sliding_window=8,
                                              layer_types=["full_attention", "sliding_attention", "full_attention"])),
        # its multimodal wrapper (no text-only LM class), with a one-layer vision tower
        "step3p7": ("Step3p7Config", dict(text_config="step3p5", vision_config=dict(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))),
        # top-k of sigmoid + the block's correction bias, renormalized, scaled; shared expert; dense first layer
        "hy_v3": ("HYV3Config", dict(num_experts=8, moe_intermediate_size=16, num_shared_experts=1,
                                     router_scaling_factor=2.5, head_dim=16)),
        # DeepSeek-V3's router; MLA with an indexer (index_topk below the prompt lengths); hyper-connections; its
        # mlp_layer_types (no first_k_dense_replace) makes layer 0 dense
        "hy_v4": ("HYV4Config", dict({k: v for k, v in grouped.items() if k != "first_k_dense_replace"},
                                     q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                     v_head_dim=8, index_topk=4, index_head_dim=8, index_n_heads=2, hc_mult=2)),
        # MiniMax-M3's language model: Step 3.7's router; dense first layer; a block-sparse indexed attention layer
        # (blocks of 2 keys, so it selects)
        "minimax_m3_vl_text": ("MiniMaxM3VLTextConfig", dict(
            num_local_experts=8, head_dim=16, rotary_dim=8, dense_intermediate_size=32, shared_intermediate_size=16,
            routed_scaling_factor=2.5, mlp_layer_types=["dense", "sparse", "sparse"],
            layer_types=["full_attention", "minimax_m3_sparse", "full_attention"], index_n_heads=1, index_head_dim=8,
            index_block_size=2, index_topk_blocks=2, index_local_blocks=1)),
        # its multimodal wrapper, with a one-layer vision tower
        "minimax_m3_vl": ("MiniMaxM3VLConfig", dict(text_config="minimax_m3_vl_text", projector_hidden_size=32,
                                                    vision_config=dict(hidden_size=32, intermediate_size=32,
                                                                       num_hidden_layers=1, num_attention_heads=2))),
        # Step 3.7's router on soft-capped logits (a cap that bites), sorted top-k; the block scales the routed sum;
        # dense first layer; a sliding-window layer
        "laguna": ("LagunaConfig", dict(num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                        head_dim=16, moe_routed_scaling_factor=2.5, moe_router_logit_softcapping=0.5,
                                        sliding_window=8,
                                        layer_types=["full_attention", "sliding_attention", "full_attention"])),
        # dense layer 1 between MoE layers 0 and 2; a sliding-window layer
        "mellum": ("MellumConfig", dict(num_experts=8, moe_intermediate_size=16, head_dim=16, sliding_window=8,
                                        mlp_layer_types=["sparse", "dense", "sparse"],
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
        # DeepSeek-V3's MLA and router; a norm on the MoE block's output
        "axk1": ("AXK1Config", dict(grouped, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                    v_head_dim=8, num_key_value_heads=2)),
        # DeepSeek-V3's router but dropped groups masked to 0, not -inf (only a negative biased score tells them
        # apart); MLA with an indexer (index_topk below the prompt lengths); gated norms
        "axk2": ("AXK2Config", dict(grouped, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                    v_head_dim=8, num_key_value_heads=2, index_topk=4, index_head_dim=8,
                                    index_n_heads=2, gated_norm_rank=4)),
        # transformers 5.25's. DeepSeek-V3's router under hybrid Kimi delta attention (a linear-attention layer, an
        # MLA one); dense first layer
        "bailing_hybrid": ("BailingHybridConfig", dict(
            num_experts=8, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1,
            num_expert_group=2, topk_group=1, routed_scaling_factor=2.5, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, head_dim=16, linear_head_dim=8, linear_num_heads=2,
            num_key_value_heads=2, layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"], first_k_dense_replace=1, num_nextn_predict_layers=0,
            expert_swiglu_limit_list=[0, 0, 0], share_expert_swiglu_limit_list=[0, 0, 0])),
        # DeepSeek-V3's grouped top-k, sorted, unscaled (the block scales the routed sum); dense first layer
        "beam": ("BeamConfig", dict(num_experts=8, moe_intermediate_size=16, n_group=2, topk_group=1,
                                    routed_scaling_factor=2.5, head_dim=16, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                    mlp_layer_types=["dense", "sparse", "sparse"])),
        # DeepSeek-V3's router; MLA with an indexer beside a sliding-window layer; dense first layer
        "dots3_note_text": ("Dots3NoteTextConfig", dict(
            grouped_bare, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            num_key_value_heads=2, head_dim=8, mlp_layer_types=["dense", "sparse", "sparse"], index_topk=4,
            index_head_dim=8, index_n_heads=2, sliding_window=8, shared_experts_intermediate_size=16,
            layer_types=["indexed_attention", "sliding_attention", "indexed_attention"])),
        # top-k of sigmoid + the router's correction bias, renormalized, scaled; shared expert; dense first layer
        "ergo": ("ErgoConfig", dict(num_experts=8, moe_intermediate_size=16, shared_intermediate_size=16,
                                    first_dense_intermediate_size=32, num_dense_blocks=1,
                                    moe_routed_scaling_factor=2.5, sliding_window=8, head_dim=16,
                                    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                    mlp_layer_types=["dense", "sparse", "sparse"])),
        # top-k of sigmoid, renormalized; shared expert; dense first layer
        "flint": ("FlintConfig", dict(num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                      mlp_only_layers=[0], sliding_window=8, head_dim=16,
                                      layer_types=["full_attention", "sliding_attention", "full_attention"])),
        # served only inside its wrapper: DeepSeek-V3's router; indexed MLA, hyper-connections; dense first layer
        "hy_v4_vl_text": ("HYV4VLTextConfig", dict(
            grouped_bare, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            num_key_value_heads=2, head_dim=8, mlp_layer_types=["dense", "sparse", "sparse"], index_topk=4,
            index_head_dim=8, index_n_heads=2, hc_mult=2, layer_types=["indexed_attention"] * 3,
            indexer_types=["full", "shared", "full"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]))),
        # top-k of sigmoid + correction bias, renormalized, scaled; hybrid sliding-window layers. Its LM head's
        # output is unpadded_vocab_size: the tiny vocabulary, so that greedy decode picks tokens it embeds
        "inkling2_text": ("Inkling2TextConfig", dict(n_routed_experts=8, moe_intermediate_size=16, head_dim=16,
                                                     unpadded_vocab_size=VOCAB,
                                                     swa_num_attention_heads=2, swa_num_key_value_heads=1,
                                                     swa_head_dim=16, sliding_window_size=8,
                                                     layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                                                     n_layers_per_attn_res_block=3)),
        "inkling2_loop_text": ("Inkling2LoopTextConfig", dict(n_routed_experts=8, moe_intermediate_size=16,
                                                              unpadded_vocab_size=VOCAB,
                                                              head_dim=16, swa_num_attention_heads=2,
                                                              swa_num_key_value_heads=1, swa_head_dim=16,
                                                              sliding_window_size=8,
                                                              layer_types=["hybrid_sliding", "hybrid",
                                                                           "hybrid_sliding"],
                                                              n_layers_per_attn_res_block=3)),
        # top-k of sigmoid + correction bias; the picked and the shared expert's sigmoids normalized together,
        # scaled (route_scale other than 1); one shared expert, so its per-token gamma rides as the shared column;
        # dense first layer (dense_mlp_idx, which the config turns into mlp_layer_types); hybrid sliding layers
        "inkling_text": ("InklingTextConfig", dict(n_routed_experts=8, moe_intermediate_size=16, n_shared_experts=1,
                                                   route_scale=2.5, dense_mlp_idx=1, head_dim=16,
                                                   unpadded_vocab_size=VOCAB, swa_num_attention_heads=2,
                                                   swa_num_key_value_heads=1, swa_head_dim=16, sliding_window_size=8,
                                                   d_rel=4, rel_extent=16,
                                                   layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"])),
        # top-k of logits + correction bias, sigmoid of those, renormalized (Kolibri 1.1 below keeps the default,
        # not); shared expert; sliding-window layers
        "kolibri1": ("Kolibri1Config", dict(num_experts=8, num_local_experts=8, moe_intermediate_size=16,
                                            norm_topk_prob=True, shared_expert_intermediate_size=16, head_dim=16,
                                            sliding_window=8,
                                            layer_types=["sliding_attention", "full_attention",
                                                         "sliding_attention"])),
        # Kolibri 1's router; dense first layer; layers reading another's keys and values
        "kolibri1_1": ("Kolibri1_1Config", dict(num_local_experts=8, moe_intermediate_size=16,
                                                shared_expert_intermediate_size=16, head_dim=16, sliding_window=8,
                                                mlp_only_layers=[0], mlp_only_intermediate_size=32,
                                                layer_types=["sliding_attention"] * 3, index_layers=[],
                                                kv_source_layers=[0, 1, 2], index_num_heads=1)),
        # Qwen3-Next's router on float32 logits; linear-attention, sliding-window and full layers
        "lara_mini": ("LaraMiniConfig", dict(num_experts=8, moe_intermediate_size=16,
                                             shared_expert_intermediate_size=16, head_dim=16, linear_key_head_dim=8,
                                             linear_value_head_dim=8, linear_num_key_heads=2,
                                             linear_num_value_heads=2, sliding_window=8,
                                             layer_types=["linear_attention", "sliding_attention",
                                                          "full_attention"])),
        # DeepSeek-V3's router; dense first layer
        "minicpm5_moe": ("MiniCPM5MoeConfig", dict(grouped_bare, head_dim=16,
                                                   mlp_layer_types=["dense", "sparse", "sparse"])),
        # served only inside its wrapper: Mistral 4's router on float32 logits, always renormalized; indexed MLA;
        # dense first layer
        "mistral_large4_text": ("MistralLarge4TextConfig", dict(
            grouped, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            num_key_value_heads=2, head_dim=8, mlp_layer_types=["dense", "sparse", "sparse"], index_topk=4,
            index_head_dim=8, index_n_heads=2, layer_types=["indexed_attention"] * 3, indexer_types=["full"] * 3,
            no_rope_layers=[1, 1, 0], kv_source_layers=[0, 1, 2])),
        # served only inside its wrapper: top-k of sigmoid (of scaled logits) + correction bias, renormalized, scaled
        "muse_spark_text": ("MuseSparkTextConfig", dict(num_local_experts=8, moe_intermediate_size=16,
                                                        moe_hidden_size=16, head_dim=16, sliding_window=8,
                                                        routed_scaling_factor=2.5,
                                                        layer_types=["sliding_attention", "full_attention",
                                                                     "sliding_attention"],
                                                        layer_rope_theta=[10000.0, 0, 10000.0],
                                                        mlp_layer_types=["sparse"] * 3)),
        # served only inside its wrapper: DeepSeek-V2's softmax, group-limited greedy top-k; dense first layer
        "unlimited_ocr_text": ("UnlimitedOcrTextConfig", dict(n_routed_experts=8, moe_intermediate_size=16,
                                                              n_shared_experts=1, n_group=2, topk_group=1,
                                                              topk_method="group_limited_greedy",
                                                              routed_scaling_factor=2.5, head_dim=16,
                                                              mlp_layer_types=["dense", "sparse", "sparse"],
                                                              sliding_window=8,
                                                              layer_types=["reference_sliding_attention"] * 3)),
        # their multimodal wrappers, each with a one-layer vision tower (and audio tower, where it has one)
        "hy_v4_vl": ("HYV4VLConfig", dict(text_config="hy_v4_vl_text", vision_config=dict(
            small_vision, num_key_value_heads=2, out_hidden_size=32))),
        "mistral_large4": ("MistralLarge4Config", dict(text_config="mistral_large4_text",
                                                       vision_config=dict(small_vision, head_dim=16, image_size=28))),
        "muse_spark": ("MuseSparkConfig", dict(text_config="muse_spark_text", vision_config=small_vision,
                                               audio_config=dict(hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1],
                                                                 out_hidden_size=32),
                                               out_hidden_size=32, projector_hidden_size=32)),
        # its vision tower's own MoE routers are not recorded: the language model's are the captured ones
        "dots3_note": ("Dots3NoteConfig", dict(text_config="dots3_note_text", vision_config=dict(
            small_vision, moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
            router_scaling_factor=1.0, mlp_layer_types=["sparse"], adapter_in_dim=32, adapter_out_dim=32),
            audio_config=dict(small_vision, num_key_value_heads=2, head_dim=16, adapter_input_size=32,
                              adapter_out_dim=32, downsample_hidden_size=8, conv_output_size=32))),
        "inkling2": ("Inkling2Config", dict(text_config="inkling2_text", vision_config=dict(
            small_vision, projection_hidden_dim=32, text_hidden_size=32))),
        "inkling2_loop": ("Inkling2LoopConfig", dict(text_config="inkling2_loop_text", vision_config=dict(
            small_vision, projection_hidden_dim=32, text_hidden_size=32))),
        "unlimited_ocr": ("UnlimitedOcrConfig", dict(text_config="unlimited_ocr_text")),
        "inkling_mm_model": ("InklingConfig", dict(text_config="inkling_text", vision_config=dict(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, text_hidden_size=32),
            audio_config=dict(text_hidden_size=32))),
        # Mamba layers around an attention layer; MoE in every layer (a router of its own only from 5.25)
        "jamba": ("JambaConfig", dict(num_experts=8, expert_layer_period=1, expert_layer_offset=0,
                                      attn_layer_period=3, attn_layer_offset=1, mamba_d_state=4, mamba_expand=1,
                                      use_mamba_kernels=False)),
        # its own names (d_model, n_layers, ffn_config: a num_experts_per_tok beside them would mislead the engine
        # adapters); the picked weights divided by their 1-norm. Its attention reads rope_theta and clip_qkv
        # from attn_config, where transformers 5.19 sets neither by default
        "dbrx": ("DbrxConfig", dict(own_names=True, vocab_size=VOCAB, d_model=32, n_heads=2, n_layers=3,
                                    max_seq_len=128, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                                    tie_word_embeddings=False,
                                    attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0),
                                    ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2))),
        # 8 routed experts and 4 zero (identity) ones, ids 8-11, picked as often as the routed ones at random
        # weights; three decoder layers of two attention sublayers each (num_hidden_layers is 6)
        "longcat_flash": ("LongcatFlashConfig", dict(own_names=True, vocab_size=VOCAB, hidden_size=32, num_layers=3,
                                                     num_attention_heads=2, ffn_hidden_size=32,
                                                     expert_ffn_hidden_size=16, moe_topk=2, n_routed_experts=8,
                                                     zero_expert_num=4, routed_scaling_factor=2.5, q_lora_rank=16,
                                                     kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                                     v_head_dim=8, head_dim=8, max_position_embeddings=128,
                                                     pad_token_id=0, eos_token_id=1, bos_token_id=2,
                                                     tie_word_embeddings=False)),
        # top-1 (all Zaya takes) of 8 experts and its skip expert, id 8, picked often at the random biases build sets
        "zaya": ("ZayaConfig", dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=1, head_dim=16,
                                    router_hidden_size=16)),
    }
    class_name, extra = specs[model_type]
    cls = getattr(transformers, class_name, None)
    if cls is None:
        return class_name, None
    if extra.pop("own_names", False):
        config = cls(**extra)
    elif isinstance(extra.get("text_config"), str):  # a multimodal wrapper: another entry's config as its text model
        text = tiny_config(extra["text_config"])[1]
        config = cls(**{**extra, "text_config": text.to_dict()}, tie_word_embeddings=False)
    else:
        config = cls(**{**common, **moe, **extra})
    config._attn_implementation = "eager"
    return class_name, config


def build(config, seed=0, dtype=torch.float32):
    global CACHE_ARG
    torch.manual_seed(seed)
    # A wrapper's config builds the wrapper where AutoModelForCausalLM would build its bare language model
    # (Qwen3.5-MoE's) or nothing (Qwen3-VL-MoE's), as does a config that transformers maps only as
    # image-text-to-text (Mistral 4's causal LM).
    auto, mapping = transformers.AutoModelForCausalLM, transformers.AutoModelForCausalLM._model_mapping
    if type(config) not in mapping or mapping[type(config)].config_class is not type(config):
        auto = transformers.AutoModelForImageTextToText
    model = auto.from_config(config).eval().to(dtype)
    if "cache" in inspect.signature(decoder_and_head(model)[0].forward).parameters:
        CACHE_ARG = "cache"
    with torch.no_grad():  # a non-zero correction bias, a per-expert scale other than 1, so they matter
        for layer in hf.find_moe_layers(model):
            for name, bias in list(layer.block.named_buffers()) + list(layer.block.named_parameters()):
                if name.endswith(("e_score_correction_bias", "expert_bias", "balancing_biases")):
                    bias.copy_(torch.randn(bias.shape) * 0.5)
                elif name.endswith("router.per_expert_scale"):
                    bias.copy_(torch.rand(bias.shape) + 0.5)
                elif name.endswith("tid2eid"):  # distinct experts for each token id
                    experts = layer.router.num_experts
                    bias.copy_(torch.stack([torch.randperm(experts)[:bias.shape[1]] for _ in range(bias.shape[0])]))
    return model


def decoder_and_head(model):
    """The decoder and the LM head: the model's, or its language model's
    (Llama 4's wrapper keeps them there). DBRX calls its decoder transformer."""
    lm = model if hasattr(model, "model") or hasattr(model, "transformer") else model.language_model
    return (lm.model if hasattr(lm, "model") else lm.transformer), lm.lm_head


def new_cache(model):
    """An empty KV cache of the kind the model's forward takes."""
    if model.config.model_type == "minimax":  # its lightning attention refuses any cache but its own
        from transformers.models.minimax.modeling_minimax import MiniMaxCache
        return MiniMaxCache()
    return transformers.DynamicCache(config=model.config)


class Unrecorded:
    """The routers output_router_logits leaves out (DeepSeek-V4's hash routers:
    the model records one router class): the inputs each was called with in a
    forward, by MoE layer index, for `references`. And the inputs of the
    routers whose recorded logits leave out their shared experts' (Inkling's),
    in `shared`."""

    def __init__(self, model, layers):
        recorded = hf._router_class(model)
        self.inputs, self.shared = {}, {}
        self.hooks = [layer.router.register_forward_hook(self._keep(self.inputs, layer.index)) for layer in layers
                      if not isinstance(layer.router, recorded)]
        self.hooks += [layer.router.register_forward_hook(self._keep(self.shared, layer.index)) for layer in layers
                       if type(layer.router).__name__.startswith("InklingTopkRouter")]

    @staticmethod
    def _keep(into, index):
        def hook(module, inputs, output):
            into[index] = inputs
        return hook

    def close(self):
        for h in self.hooks:
            h.remove()


def references(layers, out, unrecorded):
    """Each MoE layer's (ids, weights) by its own rule: from the forward's
    output_router_logits, or from the inputs `unrecorded` kept of a router the
    model does not record."""
    recorded = iter(out.router_logits)
    return [reference(layer, None, unrecorded.inputs.pop(layer.index)) if layer.index in unrecorded.inputs
            else reference(layer, next(recorded), unrecorded.shared.pop(layer.index, None)) for layer in layers]


def inkling(router, logits, inputs):
    """Inkling's rule: (ids, weights, shared gammas). The top-k of the sigmoid
    of its routed logits + correction bias; the sigmoids of the picked and of
    the shared experts' logits (taken from its input, `inputs`: the recorded
    logits leave them out), normalized together, times route_scale and
    global_scale."""
    if inputs is None:
        raise AssertionError("Inkling's reference needs its router's inputs (Unrecorded.shared)")
    hidden = inputs[0].reshape(-1, router.hidden_dim).float()
    shared = hidden @ router.weight[router.num_experts:].float().T
    logits = logits.reshape(-1, logits.shape[-1]).float()
    ids = torch.topk(logits.sigmoid() + router.e_score_correction_bias.float(), router.top_k, dim=-1,
                     sorted=False)[1]
    picked = torch.cat([logits.gather(1, ids), shared], dim=-1).sigmoid()
    w = picked / picked.sum(dim=-1, keepdim=True) * router.route_scale * router.global_scale.float()
    return ids, w[:, :router.top_k], w[:, router.top_k:]


def reference(layer, logits, inputs=None):
    """The model's own top-k from a MoE layer's output_router_logits (or, for a
    router the model does not record, from its inputs; Inkling's takes its
    shared experts' logits from its inputs): (ids, weights)."""
    router = layer.router
    kind = type(router).__name__
    if kind.startswith("DeepseekV4HashRouter"):  # experts fixed per token id; its logits are its linear's
        hidden, input_ids = inputs
        logits = hidden.reshape(-1, hidden.shape[-1]) @ router.weight.T
        scores = torch.nn.functional.softplus(logits).sqrt()
        ids = router.tid2eid[input_ids.reshape(-1)]
        w = scores.gather(1, ids)
        return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
    logits = logits.reshape(-1, logits.shape[-1])
    if kind.startswith("DbrxRouter"):  # its block's rule: softmax in the logits' dtype, top-k, over their p-norm
        w, ids = torch.topk(torch.softmax(logits, dim=1, dtype=logits.dtype), layer.block.top_k, dim=-1)
        p = layer.block.moe_normalize_expert_weights
        return ids, w if p is None else w / torch.norm(w, p=p, dim=-1, keepdim=True)
    if type(layer.block).__name__.startswith("JambaSparseMoeBlock"):  # its block's rule, or its router's (5.25)
        w, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), layer.block.top_k, dim=-1)
        return ids, w.to(logits.dtype)
    if kind.startswith("InklingTopkRouter"):  # its shared experts' logits come from its inputs
        return inkling(router, logits, inputs)[:2]
    if kind.startswith("DeepseekV4TopK"):  # sqrt-softplus scores, biased for the choice
        scores = torch.nn.functional.softplus(logits).sqrt()
        ids = torch.topk(scores + router.e_score_correction_bias, router.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
    if kind.startswith(("Mixtral", "MiniMaxTopK")):
        w, ids = torch.topk(torch.softmax(logits.float(), dim=-1), router.top_k, dim=-1)
        return ids, w / w.sum(dim=-1, keepdim=True)
    if kind.startswith(("Qwen2Moe", "Qwen3Moe", "Olmoe", "Qwen3Next", "FlexOlmo", "HunYuan", "Qwen3_5Moe",
                        "Qwen3VLMoe", "Qwen3OmniMoeThinkerText", "Qwen4ExpText", "Mellum", "LaraMini")):
        w, ids = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), router.top_k, dim=-1)
        if kind.startswith(("HunYuan", "Qwen3_5Moe", "Qwen3VLMoe")) or router.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return ids, w.to(logits.dtype)
    if kind.startswith(("GraniteMoe", "GptOss", "AriaText", "Cohere2Moe")):
        top, ids = logits.float().topk(router.top_k, dim=-1)
        if getattr(router, "expert_selection_fn", "softmax") == "sigmoid":  # Cohere2-MoE's other rule
            w = top.sigmoid()
            return ids, (w / w.sum(dim=-1, keepdim=True) if router.norm_topk_prob else w)
        return ids, torch.softmax(top, dim=-1)
    if kind.startswith("Gemma4Text"):  # its recorded router_logits are already the softmax
        w, ids = torch.topk(logits.float(), router.config.top_k_experts, dim=-1)
        return ids, w / w.sum(dim=-1, keepdim=True) * router.per_expert_scale.detach()[ids]
    if kind.startswith("Llama4Router"):  # top-k of the logits; the sigmoid of each weighs its expert's input
        top, ids = torch.topk(logits, router.top_k, dim=-1)
        return ids, torch.sigmoid(top.float()).to(logits.dtype)
    if kind.startswith("Phimoe"):
        from transformers.models.phimoe.modeling_phimoe import sparsemixer
        w, ids = sparsemixer(logits, jitter_eps=router.router_jitter_noise, training=False, top_k=router.top_k)
        return ids, w
    if kind.startswith("ZayaRouter"):  # top-k of the softmax + balancing biases; the skip expert (id 8) weighs 0
        scores = torch.softmax(logits, dim=-1)
        ids = torch.topk(scores.float() + router.balancing_biases, router.top_k, dim=-1).indices
        return ids, scores.gather(1, ids).masked_fill(ids == router.num_experts, 0)
    if kind.startswith("LongcatFlash"):  # top-k of the softmax + correction bias, over routed and zero experts
        scores = logits.float().softmax(dim=-1)
        ids = torch.topk(scores + router.e_score_correction_bias, router.top_k, dim=-1, sorted=False)[1]
        return ids, (scores.gather(1, ids) * router.routed_scaling_factor).to(logits.dtype)
    if kind.startswith(("DeepseekV2", "DeepseekOcr2Text", "UnlimitedOcrText")):
        scores = logits.float().softmax(dim=-1)
        if router.topk_method == "group_limited_greedy":  # else greedy: the top-k of all experts
            groups = scores.view(-1, router.num_group, router.num_experts // router.num_group).max(dim=-1).values
            keep = torch.zeros_like(groups).scatter_(1, torch.topk(groups, router.topk_group, dim=-1,
                                                                   sorted=False)[1], 1)
            mask = keep.unsqueeze(-1).expand(-1, router.num_group, router.num_experts // router.num_group)
            scores = scores.masked_fill(~mask.reshape(-1, router.num_experts).bool(), 0.0)
        w, ids = torch.topk(scores, router.top_k, dim=-1, sorted=False)
        return ids, w * router.routed_scaling_factor
    if kind.startswith("Ernie4_5_Moe"):
        p = torch.softmax(logits.float(), dim=1)
        ids = torch.topk(router.moe_statics(p), router.top_k, dim=-1)[1]
        w = p.gather(-1, ids)
        return ids, w / torch.clamp(w.sum(dim=-1, keepdim=True), min=router.norm_min)
    if kind.startswith(("MiniMaxM2", "Step3p7", "MiniMaxM3VL", "Laguna")):  # MiniMax-M2's bias is the block's
        scores = logits.float().sigmoid()  # Laguna's logits come soft-capped already
        bias = (layer.block if kind.startswith("MiniMaxM2") else router).e_score_correction_bias
        ids = torch.topk(scores + bias, router.top_k, dim=-1, sorted=kind.startswith("Laguna"))[1]
        w = scores.gather(1, ids)
        return ids, w / w.sum(dim=-1, keepdim=True)
    if kind.startswith("Lfm2Moe"):  # the expert bias is the block's, passed to the router's forward
        scores = logits.sigmoid()
        choice = scores + layer.block.expert_bias if router.use_expert_bias else scores
        ids = torch.topk(choice, router.top_k, dim=-1)[1]
        w = scores.gather(1, ids)
        if router.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-6)
        return ids, w * router.routed_scaling_factor
    if kind.startswith(("Afmoe", "HYV3")):  # the bias is the block's, passed to the router's forward
        scores = logits.float().sigmoid()
        afmoe = kind.startswith("Afmoe")
        bias = layer.block.expert_bias if afmoe else layer.block.e_score_correction_bias
        ids = torch.topk(scores + bias, router.top_k, dim=-1, sorted=afmoe)[1]
        w = scores.gather(1, ids)
        scale = router.route_scale if afmoe else router.router_scaling_factor
        return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale
    if kind.startswith(("Flint", "Kolibri1")):  # Flint: top-k of the sigmoid; Kolibri 1: of the biased logits
        if kind.startswith("Flint"):
            w, ids = torch.topk(logits.float().sigmoid(), router.top_k, dim=-1)
        else:
            ids = torch.topk(logits.float() + router.e_score_correction_bias, router.top_k, dim=-1)[1]
            w = logits.float().gather(1, ids).sigmoid()
        return ids, (w / w.sum(dim=-1, keepdim=True) if router.norm_topk_prob else w)
    if kind.startswith(("Ergo", "MuseSpark", "Inkling2")):  # the router's bias; Muse Spark's logits come scaled
        scores = router.score_fn(logits.float()) if kind.startswith("Inkling2") else logits.float().sigmoid()
        ids = torch.topk(scores + router.e_score_correction_bias, router.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        eps = getattr(router, "norm_topk_prob_eps", 1e-20)
        return ids, w / (w.sum(dim=-1, keepdim=True) + eps) * router.routed_scaling_factor
    if kind.startswith(("DeepseekV3", "Glm4Moe", "Dots1", "SolarOpen", "NemotronH", "GlmMoeDsa", "KimiLinear",
                        "Mistral4", "Glm5NextText", "Glm4vMoeText", "ExaoneMoe", "MiMoV2Flash", "HYV4", "AXK1",
                        "AXK2", "MiniCPM5Moe", "BailingHybrid", "Dots3NoteText", "MistralLarge4Text", "Beam")):
        # Mistral 4's (and Mistral Large 4's): softmax in the logits' dtype, no bias, dropped groups score 0
        softmax = kind.startswith(("Mistral4", "MistralLarge4"))
        ordered = kind.startswith("Beam")  # Beam's top-k (of the groups too) is sorted
        scores = logits.softmax(-1) if softmax else logits.float().sigmoid()
        choice = scores if softmax else scores + router.e_score_correction_bias
        if router.num_group is not None:  # A.X-K2's light checkpoints route without groups
            groups = choice.view(-1, router.num_group, router.num_experts // router.num_group)
            group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, router.topk_group, dim=-1,
                                                                         sorted=ordered)[1], 1)
            mask = keep.unsqueeze(-1).expand_as(groups).reshape(-1, router.num_experts).bool()
            # A.X-K2 too scores dropped groups 0: an expert whose biased score is negative loses to them
            choice = choice.masked_fill(~mask, 0.0 if softmax or kind.startswith("AXK2") else float("-inf"))
        ids = torch.topk(choice, router.top_k, dim=-1, sorted=ordered)[1]
        w = scores.gather(1, ids)
        if kind.startswith("MistralLarge4") or router.norm_topk_prob:  # Mistral Large 4's always renormalizes
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, w if kind.startswith("Beam") else w * router.routed_scaling_factor  # Beam's block scales its sum
    raise AssertionError(f"no reference for {kind}")


class AllGather:
    """all_gather over rank threads: every rank passes its part, all get all parts."""

    def __init__(self, ranks):
        self.parts = [None] * ranks
        self.barrier = threading.Barrier(ranks, timeout=120)

    def __call__(self, rank, part):
        self.parts[rank] = part
        self.barrier.wait()
        parts = list(self.parts)
        self.barrier.wait()
        return parts

    def rows(self, rank):
        """The DP gather of one MoE layer's routing: ranks back to back."""
        def gather(layer, ids, weights):
            parts = self(rank, (ids, weights))
            ids = torch.cat([p[0] for p in parts])
            weights = None if weights is None else torch.cat([p[1].float() for p in parts])
            return ids, weights
        return gather


class Request:
    def __init__(self, rid, prompt, new_tokens):
        self.rid = rid
        self.prompt = list(prompt)
        self.new_tokens = new_tokens  # tokens to generate; the last is never forwarded
        self.generated = []
        self.expected_ids = []        # [layers, top_k] per forwarded token, from the model's logits
        self.expected_weights = []
        self.routed = None            # the RoutedExperts read at finish

    @property
    def forwarded(self):
        return len(self.prompt) + len(self.generated) - (1 if self.done else 0)

    @property
    def done(self):
        return len(self.generated) >= self.new_tokens


class Rank:
    """One attention-DP rank: a model replica, its capturer, its requests."""

    def __init__(self, model, rank, dp_size, gather, host_slots, rows_per_rank, seed, shared_column, weight_dtype):
        self.model, self.rank, self.dp_size, self.gather = model, rank, dp_size, gather
        layers = hf.find_moe_layers(model)
        top_k, num_experts = hf._routing_dims(model, layers[0].router)
        self.capturer = moecap.Capturer(
            num_layers=len(layers), top_k=top_k, num_experts=num_experts, host_slots=host_slots,
            max_running_requests=8, chunked_prefill_size=rows_per_rank, dp_size=dp_size, weight_dtype=weight_dtype,
            extra_columns=1 if shared_column else 0)
        self.handle = hf.attach(model, self.capturer, gather=gather.rows(rank) if dp_size > 1 else None)
        self.table = RequestTable(self.capturer)
        self.rng = np.random.default_rng(seed)
        self.free = list(self.rng.permutation(host_slots))
        self.finished = []
        self.steps = {"prefill": 0, "decode": 0, "idle": 0}

    def step_header(self, rows, working):
        """Every step starts with the ranks exchanging their row counts (and
        whether they still have work): (tokens_per_rank, anyone working)."""
        if self.dp_size == 1:
            return [rows], working
        parts = self.gather(self.rank, (rows, working))
        return [p[0] for p in parts], any(p[1] for p in parts)

    def idle(self, working=True):
        """A step with no tokens here: the MoE layers still join the gathers.
        False (and nothing done) once no rank has work left."""
        tokens_per_rank, anyone = self.step_header(0, working)
        if not anyone:
            return False
        self.handle.idle_step()
        commit_batch(self.capturer, np.empty(0, dtype=np.int64), self.rank, tokens_per_rank)
        self.steps["idle"] += 1
        return True

    def forward(self, batch, input_ids, mask, real, cache):
        """One step: input_ids [B, S], mask the attention mask so far, real [B, S]
        which new tokens are real (else padding or a finished row)."""
        tokens_per_rank, _ = self.step_header(input_ids.numel(), True)
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
        unrecorded = Unrecorded(self.model, self.handle.layers)
        with torch.no_grad():
            # The decoder itself, not the LM wrapper: some wrappers (GraniteMoE) compute an
            # aux loss from router logits and the full attention mask that breaks with a cache.
            decoder, head = decoder_and_head(self.model)
            out = decoder(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                          use_cache=True, output_router_logits=True, **{CACHE_ARG: cache})
            out.logits = head(out.last_hidden_state)  # argmax is all decode needs
        unrecorded.close()
        per_row = []
        for b, req in enumerate(batch):
            n = int(real[b].sum())
            slots = [int(self.free.pop()) for _ in range(n)]
            per_row.append(slots)
            if n:
                self.table.append(req.rid, slots)
        slots = batch_slots(real, per_row)
        commit_batch(self.capturer, slots, self.rank, tokens_per_rank)
        expected = references(self.handle.layers, out, unrecorded)
        flat_real = real.reshape(-1)
        for b, req in enumerate(batch):
            for s in range(input_ids.shape[1]):
                i = b * input_ids.shape[1] + s
                if flat_real[i]:
                    req.expected_ids.append(torch.stack([e[0][i] for e in expected]))
                    req.expected_weights.append(torch.stack([e[1][i].float() for e in expected]))
        return out

    def finish(self, req):
        req.slots = self.table.slots(req.rid)
        req.routed = self.table.finish(req.rid)
        self.free.extend(int(s) for s in req.slots)  # the next wave reuses them
        self.finished.append(req)

    def serve(self, wave, chunk, schedule):
        """Serves one wave as a left-padded batch; `schedule` says, per global
        step, whether this rank runs (the others may be idle)."""
        width = max(len(r.prompt) for r in wave)
        ids = torch.zeros((len(wave), width), dtype=torch.long)
        prompt_mask = torch.zeros((len(wave), width), dtype=torch.long)
        for b, r in enumerate(wave):
            ids[b, width - len(r.prompt):] = torch.tensor(r.prompt)
            prompt_mask[b, width - len(r.prompt):] = 1
            self.table.start(r.rid)
        cache = new_cache(self.model)
        out = None
        for c0 in range(0, width, chunk):
            while not next(schedule):
                self.idle()
            mask = prompt_mask[:, :c0 + chunk]
            out = self.forward(wave, ids[:, c0:c0 + chunk], mask, prompt_mask[:, c0:c0 + chunk].bool(), cache)
            self.steps["prefill"] += 1
        for b, r in enumerate(wave):
            r.generated.append(int(out.logits[b, -1].argmax()))
        while True:
            live = torch.tensor([not r.done for r in wave])
            if not live.any():
                break
            while not next(schedule):
                self.idle()
            step_ids = torch.tensor([[r.generated[-1]] for r in wave])
            mask = torch.cat([mask, torch.ones((len(wave), 1), dtype=torch.long)], dim=1)
            out = self.forward(wave, step_ids, mask, live[:, None], cache)
            self.steps["decode"] += 1
            for b, r in enumerate(wave):
                if not r.done:
                    r.generated.append(int(out.logits[b, -1].argmax()))
        for r in wave:
            self.finish(r)


def serve(config, dp_size, waves_per_rank, active, chunk=3, host_slots=96, seed=0, dtype=torch.float32):
    """Serves `waves_per_rank[r]` waves on each rank; active[r](step) says when
    rank r runs (False: idle that step). Returns the ranks."""
    model = build(config, dtype=dtype)
    weight_dtype = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    shared = any(layer.shared is not None for layer in hf.find_moe_layers(model))
    gather = AllGather(dp_size)
    batch = max(len(w) for waves in waves_per_rank for w in waves)
    # Replicas before any attach: deepcopy would copy the hooks too.
    models = [model] + [copy.deepcopy(model) for _ in range(dp_size - 1)]
    ranks = [Rank(models[r], r, dp_size, gather, host_slots, batch * chunk, seed + r, shared, weight_dtype)
             for r in range(dp_size)]
    errors = []

    def run(rank):
        try:
            def schedule():
                step = 0
                while True:
                    yield active[rank.rank](step)
                    step += 1
            steps = schedule()
            for wave in waves_per_rank[rank.rank]:
                rank.serve(wave, chunk, steps)
            while rank.idle(working=False):  # lockstep until no rank has work
                pass
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)
            gather.barrier.abort()

    if dp_size == 1:
        run(ranks[0])
    else:
        threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return ranks
