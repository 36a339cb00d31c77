"""Model shapes `ninfer bench --shape` builds with random weights: the real Qwen3.5-27B and
Qwen3.5-35B-A3B text configs (HF config.json fields) and tiny ones for CPU runs and tests."""

from __future__ import annotations

from typing import Any

_ROPE = {
    "rope_type": "default",
    "rope_theta": 1e7,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}

# What the two tiny shapes share (CPU tests and examples).
_TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": dict(_ROPE, mrope_section=[2, 1, 1]),
    "tie_word_embeddings": False,
}

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_5-27b": {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "full_attention_interval": 4,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "rope_parameters": _ROPE,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
    },
    "qwen3_5-35b-a3b": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "full_attention_interval": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": _ROPE,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
    },
    "tiny": {"model_type": "qwen3_5_text", "intermediate_size": 128, **_TINY},
    "tiny-moe": {
        "model_type": "qwen3_5_moe_text",
        **_TINY,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
}
