"""GPT-2 (``GPT2LMHeadModel``) as TensorRT-LLM's ``GPTForCausalLM``."""

from __future__ import annotations

from forge.llm.adapter import COLUMN, QKV, ROW, VOCAB, DecoderAdapter, LoraTarget, Weight


class GPTAdapter(DecoderAdapter):
    family = "gpt"
    description = "GPT-2 decoders (GPT2LMHeadModel) as TensorRT-LLM GPTForCausalLM"
    architectures = ("GPT2LMHeadModel",)
    trtllm_architecture = "GPTForCausalLM"
    modelopt_decoder = "gpt"

    config_fields = {
        "hidden_size": ("n_embd", "hidden_size"),
        "num_layers": ("n_layer", "num_hidden_layers"),
        "num_heads": ("n_head", "num_attention_heads"),
        "num_kv_heads": ("n_kv_head",),
        "head_size": (),
        "vocab_size": ("vocab_size",),
        "max_position_embeddings": ("n_positions", "max_position_embeddings"),
        "intermediate_size": ("n_inner",),
        "norm_epsilon": ("layer_norm_epsilon",),
        "hidden_act": ("activation_function",),
        "tie_word_embeddings": ("tie_word_embeddings",),
    }
    config_defaults = {
        "num_kv_heads": lambda c: c["num_heads"],
        "head_size": lambda c: c["hidden_size"] // c["num_heads"],
        "intermediate_size": lambda c: 4 * c["hidden_size"],
        "norm_epsilon": 1e-5,
        "hidden_act": "gelu_new",
        "tie_word_embeddings": True,
    }
    trtllm_constants = {"gpt_variant": "gpt2", "bias": True, "position_embedding_type": "learned_absolute"}
    unsupported = {
        "scale_attn_by_inverse_layer_idx": (True, "TensorRT-LLM's GPT attention has no per-layer 1/(layer+1) scale"),
        "scale_attn_weights": (False, "TensorRT-LLM's GPT attention always scales scores by 1/sqrt(head_size)"),
        "add_cross_attention": (True, "cross-attention layers belong to encoder-decoder models"),
    }

    # Hub GPT-2 files name tensors without the "transformer." base; transformers saves them with it.
    weight_prefixes = ("transformer.", "")
    layer_weights = {
        "input_layernorm.weight": Weight("h.{i}.ln_1.weight", ("hidden_size",)),
        "input_layernorm.bias": Weight("h.{i}.ln_1.bias", ("hidden_size",)),
        "attention.qkv.weight": Weight("h.{i}.attn.c_attn.weight", ("qkv_dim", "hidden_size"), QKV, transpose=True),
        "attention.qkv.bias": Weight("h.{i}.attn.c_attn.bias", ("qkv_dim",), QKV),
        "attention.dense.weight": Weight("h.{i}.attn.c_proj.weight", ("hidden_size", "q_dim"), ROW, transpose=True),
        "attention.dense.bias": Weight("h.{i}.attn.c_proj.bias", ("hidden_size",)),
        "post_layernorm.weight": Weight("h.{i}.ln_2.weight", ("hidden_size",)),
        "post_layernorm.bias": Weight("h.{i}.ln_2.bias", ("hidden_size",)),
        "mlp.fc.weight": Weight("h.{i}.mlp.c_fc.weight", ("intermediate_size", "hidden_size"), COLUMN, transpose=True),
        "mlp.fc.bias": Weight("h.{i}.mlp.c_fc.bias", ("intermediate_size",), COLUMN),
        "mlp.proj.weight": Weight("h.{i}.mlp.c_proj.weight", ("hidden_size", "intermediate_size"), ROW, transpose=True),
        "mlp.proj.bias": Weight("h.{i}.mlp.c_proj.bias", ("hidden_size",)),
    }
    first_stage_weights = {
        "transformer.vocab_embedding.weight": Weight("wte.weight", ("vocab_size", "hidden_size")),
        "transformer.position_embedding.weight": Weight("wpe.weight", ("max_position_embeddings", "hidden_size")),
    }
    last_stage_weights = {
        "transformer.ln_f.weight": Weight("ln_f.weight", ("hidden_size",)),
        "transformer.ln_f.bias": Weight("ln_f.bias", ("hidden_size",)),
        "lm_head.weight": Weight("lm_head.weight", ("vocab_size", "hidden_size"), VOCAB, tied="wte.weight"),
    }
    # GPT-2 fuses Q, K and V in c_attn, so its LoRA is TensorRT-LLM's attn_qkv. (TensorRT-LLM's own HF
    # mapping for GPT names only c_fc/c_proj, which sends attn.c_proj to mlp_4h_to_h; the paths keep them apart.)
    lora_targets = {
        "transformer.h.{i}.attn.c_attn": LoraTarget("attn_qkv", ("qkv_dim", "hidden_size"), QKV),
        "transformer.h.{i}.attn.c_proj": LoraTarget("attn_dense", ("hidden_size", "q_dim"), ROW),
        "transformer.h.{i}.mlp.c_fc": LoraTarget("mlp_h_to_4h", ("intermediate_size", "hidden_size"), COLUMN),
        "transformer.h.{i}.mlp.c_proj": LoraTarget("mlp_4h_to_h", ("hidden_size", "intermediate_size"), ROW),
    }


ADAPTER = GPTAdapter()
