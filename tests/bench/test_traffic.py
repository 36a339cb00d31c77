"""The speed-of-light model against numbers computed by hand from the real configs
(Qwen3.5-27B and Qwen3.5-35B-A3B; the per-component totals of the model notes)."""

from __future__ import annotations

import pytest

from ninfer.bench.shapes import SHAPES
from ninfer.bench.traffic import (
    Traffic,
    expected_distinct_experts,
    format_bytes,
    profile_formats,
)

DENSE = SHAPES["qwen3_5-27b"]
MOE = SHAPES["qwen3_5-35b-a3b"]

# 27B, by hand: per GDN layer in_proj_qkv 10240x5120 + in_proj_z 6144x5120 + in_proj_b/a 48x5120
# + out_proj 5120x6144; per attention layer q 12288x5120 + k, v 1024x5120 + o 5120x6144;
# MLP 3 x 17408x5120; head 248320x5120.
GDN_27B = 48 * (10240 * 5120 + 6144 * 5120 + 2 * 48 * 5120 + 5120 * 6144)
ATTN_27B = 16 * (12288 * 5120 + 2 * 1024 * 5120 + 5120 * 6144)
MLP_27B = 64 * 3 * 17408 * 5120
HEAD_27B = 248320 * 5120
LINEARS_27B = GDN_27B + ATTN_27B + MLP_27B + HEAD_27B
# norms (2 per layer + final), q/k norms, conv taps, A_log, dt_bias, GDN output norm
SMALL_27B = 64 * 2 * 5120 + 5120 + 16 * 2 * 256 + 48 * (10240 * 4 + 48 + 48 + 128)

# 35B-A3B, by hand: GDN 8192x2048 + 4096x2048 + 2 x 32x2048 + 2048x4096; attention
# 8192x2048 + 2 x 512x2048 + 2048x4096; router 256x2048 + shared gate 1x2048; shared expert and
# each routed expert 3 x 512x2048; head 248320x2048.
GDN_35B = 30 * (8192 * 2048 + 4096 * 2048 + 2 * 32 * 2048 + 2048 * 4096)
ATTN_35B = 10 * (8192 * 2048 + 2 * 512 * 2048 + 2048 * 4096)
ROUTER_35B = 40 * (256 * 2048 + 2048)
SHARED_35B = 40 * 3 * 512 * 2048
EXPERT_35B = 3 * 512 * 2048
HEAD_35B = 248320 * 2048
SMALL_35B = 40 * 2 * 2048 + 2048 + 10 * 2 * 256 + 30 * (8192 * 4 + 32 + 32 + 128)


def uniform(fmt: str):
    """Every linear (matrix, not the conv taps) in `fmt`, the rest bf16: the notes' assumption."""

    def format_of(name: str, shape: tuple[int, ...]) -> str:
        if len(shape) >= 2 and not name.endswith("conv1d.weight"):
            return fmt
        return "bf16"

    return format_of


def test_hand_counts_match_the_model_notes_totals():
    assert GDN_27B == 5_560_074_240
    assert ATTN_27B == 1_677_721_600
    assert MLP_27B == 17_112_760_320
    assert LINEARS_27B == 25_621_954_560  # "25.62B"
    assert SMALL_27B == 2_645_504  # "2.65M"
    active_35b = GDN_35B + ATTN_35B + ROUTER_35B + SHARED_35B + 8 * 40 * EXPERT_35B + HEAD_35B
    assert active_35b == 2_945_269_760  # "2.945B"


def test_27b_bf16_decode_step_at_empty_context():
    step = Traffic(DENSE, uniform("bf16")).decode_bytes([0])
    # every weight once, plus one embedding row
    assert step.weights == 2 * (LINEARS_27B + SMALL_27B + 5120)
    assert step.weights / 1e9 == pytest.approx(51.25, abs=0.01)
    # fp32 GDN state 48 layers x 48 heads x 128 x 128 read + written; conv window K-1 = 3
    assert step.recurrent_state == 2 * 48 * 48 * 128 * 128 * 4
    assert step.conv_state == 2 * 48 * 10240 * 3 * 2
    assert (step.recurrent_state + step.conv_state) / 1e9 == pytest.approx(0.31, abs=0.005)
    # the new token's K and V: 16 layers x 2 x 4 heads x 256 x 2 B = 64 KiB, read and written
    assert step.kv_read == step.kv_write == 65536


def test_27b_quantized_weight_bytes_include_scales():
    q4 = Traffic(DENSE, uniform("q4_g64_fp16")).decode_bytes([0]).weights
    # 4 bits + one fp16 scale per 64 weights = 0.53125 B per weight (the notes' "4.25 bit")
    # the embedding row is a q4 row too
    assert q4 == (LINEARS_27B + 5120) * 0.53125 + 2 * SMALL_27B
    assert q4 / 1e9 == pytest.approx(13.62, abs=0.02)
    q8 = Traffic(DENSE, uniform("q8_g32_fp16")).decode_bytes([0]).weights
    assert q8 == (LINEARS_27B + 5120) * (1 + 2 / 32) + 2 * SMALL_27B


def test_27b_kv_read_grows_64_kib_per_context_token():
    traffic = Traffic(DENSE, uniform("bf16"))
    step = traffic.decode_bytes([4095])
    assert step.kv_read == 4096 * 65536
    assert step.kv_read / 1e9 == pytest.approx(0.27, abs=0.005)
    batch = traffic.decode_bytes([10, 100, 1000])
    assert batch.kv_read == (11 + 101 + 1001) * 65536
    assert batch.weights == traffic.decode_bytes([0]).weights + 2 * 2 * 5120  # 2 more rows
    assert batch.recurrent_state == 3 * traffic.decode_bytes([0]).recurrent_state


def test_35b_a3b_decode_reads_top_k_experts_for_one_sequence():
    traffic = Traffic(MOE, uniform("bf16"))
    step = traffic.decode_bytes([0])
    active = GDN_35B + ATTN_35B + ROUTER_35B + SHARED_35B + 8 * 40 * EXPERT_35B + HEAD_35B
    assert step.weights == 2 * (active + SMALL_35B + 2048)
    assert step.weights / 1e9 == pytest.approx(5.89, abs=0.01)
    assert step.recurrent_state + step.conv_state == 2 * 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    assert step.kv_read == 10 * 2 * 2 * 256 * 2  # 20 KiB per token


def test_35b_a3b_batch_touches_more_experts():
    traffic = Traffic(MOE, uniform("bf16"))
    one = traffic.decode_bytes([0]).weights
    eight = traffic.decode_bytes([0] * 8).weights
    distinct = 256 * (1 - (1 - 8 / 256) ** 8)
    extra_experts = (distinct - 8) * 40 * EXPERT_35B * 2
    assert eight - one == pytest.approx(extra_experts + 7 * 2048 * 2, rel=1e-9)


def test_expected_distinct_experts():
    assert expected_distinct_experts(256, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(256, 8, 10_000) == pytest.approx(256)
    assert expected_distinct_experts(4, 2, 2) == pytest.approx(4 * (1 - 0.25))
    assert expected_distinct_experts(0, 0, 5) == 0


def test_prefill_flops_27b_one_token_then_a_chunk_after_a_prefix():
    traffic = Traffic(DENSE, uniform("bf16"))
    linears = LINEARS_27B - HEAD_27B
    gdn_per_token = 48 * (7 * 48 * 128 * 128 + 2 * 10240 * 4)
    one = traffic.prefill_flops([0], [1], [True])
    assert one == 2 * linears + 2 * HEAD_27B + 16 * 4 * 24 * 256 * 1 + gdn_per_token
    # 128 new tokens after 1000 cached: token j attends to 1000 + j positions; head for 1 row
    chunk = traffic.prefill_flops([1000], [128], [False])
    attended = 128 * 1000 + 128 * 129 // 2
    assert chunk == 128 * (2 * linears + gdn_per_token) + 16 * 4 * 24 * 256 * attended


def test_prefill_flops_35b_count_top_k_experts_per_token():
    traffic = Traffic(MOE, uniform("bf16"))
    per_token = GDN_35B + ATTN_35B + ROUTER_35B + SHARED_35B + 8 * 40 * EXPERT_35B
    assert traffic.matmul_params_per_token() == pytest.approx(per_token)
    assert traffic.matmul_params_per_token() / 1e9 == pytest.approx(2.437, abs=0.001)


def test_profile_formats_follow_the_converter():
    q4 = profile_formats(DENSE, "q4")
    assert q4("text/layers.0.mlp.up_proj.weight", (17408, 5120)) == "q4_g64_fp16"
    assert q4("text/lm_head.weight", (248320, 5120)) == "q6_g64_fp16"
    assert q4("text/layers.0.linear_attn.in_proj_a.weight", (48, 5120)) == "bf16"
    assert q4("text/layers.0.input_layernorm.weight", (5120,)) == "bf16"
    q8 = profile_formats(DENSE, "q8")
    assert q8("text/lm_head.weight", (248320, 5120)) == "q8_g32_fp16"
    assert q8("text/layers.0.linear_attn.A_log", (48,)) == "fp32"
    bf16 = profile_formats(MOE, "bf16")
    assert bf16("text/layers.0.mlp.experts.down_proj", (256, 2048, 512)) == "bf16"
    with pytest.raises(ValueError):
        profile_formats(DENSE, "q3")


def test_format_bytes_counts_codes_and_scales():
    assert format_bytes("bf16", (3, 5)) == 30
    assert format_bytes("q4_g64_fp16", (2, 128)) == 2 * 64 + 2 * 2 * 2
    assert format_bytes("q8_g32_fp16", (1, 40)) == 64 + 2 * 2  # K padded to the group
