"""Llama-style decoders (``LlamaForCausalLM``, ``MistralForCausalLM``; GQA) as TensorRT-LLM's LLaMA."""

from __future__ import annotations

from typing import Any, Mapping

from forge.llm.adapter import COLUMN, KV, QKV, ROW, VOCAB, DecoderAdapter, LoraTarget, Weight

_ATTN = "model.layers.{i}.self_attn."
_MLP = "model.layers.{i}.mlp."


class LlamaAdapter(DecoderAdapter):
    family = "llama"
    description = "Llama-style decoders (LlamaForCausalLM, MistralForCausalLM; GQA) as TensorRT-LLM LLaMA"
    architectures = ("LlamaForCausalLM", "MistralForCausalLM")
    trtllm_architecture = "LlamaForCausalLM"  # TensorRT-LLM builds Mistral with its LLaMA model too
    modelopt_decoder = "llama"

    config_fields = {
        "hidden_size": ("hidden_size",),
        "num_layers": ("num_hidden_layers",),
        "num_heads": ("num_attention_heads",),
        "num_kv_heads": ("num_key_value_heads",),
        "head_size": ("head_dim",),
        "vocab_size": ("vocab_size",),
        "max_position_embeddings": ("max_position_embeddings",),
        "intermediate_size": ("intermediate_size",),
        "norm_epsilon": ("rms_norm_eps",),
        "hidden_act": ("hidden_act",),
        "rotary_base": ("rope_parameters.rope_theta", "rope_theta"),
        "attn_bias": ("attention_bias",),
        "mlp_bias": ("mlp_bias",),
        "tie_word_embeddings": ("tie_word_embeddings",),
        "sliding_window": ("sliding_window",),
    }
    config_defaults = {
        "num_kv_heads": lambda c: c["num_heads"],
        "head_size": lambda c: c["hidden_size"] // c["num_heads"],
        "norm_epsilon": 1e-6,
        "hidden_act": "silu",
        "rotary_base": 10000.0,
        "attn_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    trtllm_fields = {"rotary_base": "rotary_base", "rotary_scaling": "rotary_scaling",
                     "attn_bias": "attn_bias", "mlp_bias": "mlp_bias"}
    trtllm_constants = {"position_embedding_type": "rope_gpt_neox", "residual_mlp": False}

    layer_weights = {
        "input_layernorm.weight": Weight("model.layers.{i}.input_layernorm.weight", ("hidden_size",)),
        "attention.qkv.weight": Weight((_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"),
                                       ("qkv_dim", "hidden_size"), QKV),
        "attention.qkv.bias": Weight((_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias"),
                                     ("qkv_dim",), QKV, when="attn_bias"),
        "attention.dense.weight": Weight(_ATTN + "o_proj.weight", ("hidden_size", "q_dim"), ROW),
        "attention.dense.bias": Weight(_ATTN + "o_proj.bias", ("hidden_size",), when="attn_bias"),
        "post_layernorm.weight": Weight("model.layers.{i}.post_attention_layernorm.weight", ("hidden_size",)),
        # TensorRT-LLM's GatedMLP computes act(fc(x)) * gate(x): HF gate_proj is its fc, up_proj its gate.
        "mlp.fc.weight": Weight(_MLP + "gate_proj.weight", ("intermediate_size", "hidden_size"), COLUMN),
        "mlp.fc.bias": Weight(_MLP + "gate_proj.bias", ("intermediate_size",), COLUMN, when="mlp_bias"),
        "mlp.gate.weight": Weight(_MLP + "up_proj.weight", ("intermediate_size", "hidden_size"), COLUMN),
        "mlp.gate.bias": Weight(_MLP + "up_proj.bias", ("intermediate_size",), COLUMN, when="mlp_bias"),
        "mlp.proj.weight": Weight(_MLP + "down_proj.weight", ("hidden_size", "intermediate_size"), ROW),
        "mlp.proj.bias": Weight(_MLP + "down_proj.bias", ("hidden_size",), when="mlp_bias"),
    }
    first_stage_weights = {
        "transformer.vocab_embedding.weight": Weight("model.embed_tokens.weight", ("vocab_size", "hidden_size")),
    }
    last_stage_weights = {
        "transformer.ln_f.weight": Weight("model.norm.weight", ("hidden_size",)),
        "lm_head.weight": Weight("lm_head.weight", ("vocab_size", "hidden_size"), VOCAB,
                                 tied="model.embed_tokens.weight"),
    }
    # TensorRT-LLM's LoRA modules of its LLaMA (lora_manager's default HF mapping): gate_proj is mlp_h_to_4h
    # and up_proj mlp_gate, as in the GatedMLP weights above.
    lora_targets = {
        _ATTN + "q_proj": LoraTarget("attn_q", ("q_dim", "hidden_size"), COLUMN),
        _ATTN + "k_proj": LoraTarget("attn_k", ("kv_dim", "hidden_size"), KV),
        _ATTN + "v_proj": LoraTarget("attn_v", ("kv_dim", "hidden_size"), KV),
        _ATTN + "o_proj": LoraTarget("attn_dense", ("hidden_size", "q_dim"), ROW),
        _MLP + "gate_proj": LoraTarget("mlp_h_to_4h", ("intermediate_size", "hidden_size"), COLUMN),
        _MLP + "up_proj": LoraTarget("mlp_gate", ("intermediate_size", "hidden_size"), COLUMN),
        _MLP + "down_proj": LoraTarget("mlp_4h_to_h", ("hidden_size", "intermediate_size"), ROW),
    }

    def normalize_extra(self, hf_config: Mapping[str, Any], norm: dict[str, Any]) -> None:
        # transformers ≥ 5 keeps RoPE settings in rope_parameters; older configs use rope_scaling.
        scaling = hf_config.get("rope_scaling")
        params = hf_config.get("rope_parameters") or {}
        if not scaling and params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling and "type" not in scaling and "rope_type" in scaling:
            scaling = {**scaling, "type": scaling["rope_type"]}
        norm["rotary_scaling"] = scaling or None


ADAPTER = LlamaAdapter()
