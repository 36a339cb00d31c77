"""`GroupwiseExperts` and `quantize_experts` on the CPU: MoE experts kept in their stored
group-wise int form compute what the dequantized `Experts` compute, on the grouped path
(decode-sized batches) and the per-expert path (prefill), with expert-parallel ranges and tied
router scores; only experts stored whole in a GEMV format are kept encoded; a groupwise-int MoE
artifact loaded with encoded experts gives the logits of its dequantized load. The grouped
kernel itself runs under Triton's interpreter (tests/kernels/test_grouped_gemv_interpreted.py)
and compiled (tests/gpu/test_moe_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from tiny_qwen import Runner, rel_err
from torch import nn

from ninfer.artifact.artifact import Artifact
from ninfer.models import qwen3_5
from ninfer.models.layers import moe
from ninfer.models.layers.linear import GroupwiseLinear
from ninfer.models.layers.moe import (
    GATHERED_MAX_TOKENS,
    Experts,
    GroupwiseExperts,
    SparseMoE,
    quantize_experts,
)
from ninfer.models.registry import load_model
from ninfer.models.weights import StateDictSource
from ninfer.quant import get_format

HIDDEN, WIDTH, NUM_EXPERTS, TOP_K = 128, 96, 8, 3  # WIDTH pads down_proj's K to the group
TOKEN_COUNTS = [0, 1, 5, GATHERED_MAX_TOKENS, GATHERED_MAX_TOKENS + 1, 150]


def stored_source(gate_up_format: str, down_format: str | None = None) -> StateDictSource:
    """The stacked experts of one layer as a converter stores them, under `x/moe.experts.*`."""
    gate_up = torch.randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN) * HIDDEN**-0.5
    down = torch.randn(NUM_EXPERTS, HIDDEN, WIDTH) * WIDTH**-0.5
    return StateDictSource(
        {},
        {
            "x/moe.experts.gate_up_proj": get_format(gate_up_format).encode(gate_up),
            "x/moe.experts.down_proj": get_format(down_format or gate_up_format).encode(down),
        },
    )


def logical(name: str) -> str:
    return "x/" + name


def both_forms(
    source: StateDictSource, held: range, dtype: torch.dtype = torch.float32
) -> tuple[Experts, GroupwiseExperts]:
    """(the dequantized experts of `held`, as the CPU path loads them; the encoded ones)."""
    dense = Experts(held, HIDDEN, WIDTH)
    for proj in ("gate_up_proj", "down_proj"):
        full = source.tensor(logical(f"moe.experts.{proj}"), dtype=dtype)
        getattr(dense, proj).data = full[held.start : held.stop]
    with torch.device("meta"):
        model = nn.Module()
        model.moe = nn.Module()
        model.moe.experts = Experts(held, HIDDEN, WIDTH)
    assert quantize_experts(model, source, torch.device("cpu"), logical) == ["moe.experts"]
    return dense, model.moe.experts


def route(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMoE's routing of random scores: top-k experts [T, k] and renormalised weights."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(tokens, NUM_EXPERTS, generator=generator), dim=-1)
    weights, experts = probs.topk(TOP_K, dim=-1)
    return experts, weights / weights.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("held", [range(NUM_EXPERTS), range(2, 5)], ids=["all", "ep-rank"])
@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
def test_encoded_experts_compute_the_dequantized_experts(format_name, held, tokens):
    dense, encoded = both_forms(stored_source(format_name), held)
    experts, weights = route(tokens)
    x = torch.randn(tokens, HIDDEN)
    torch.testing.assert_close(encoded(x, experts, weights), dense(x, experts, weights))


@pytest.mark.parametrize("tokens", [3, GATHERED_MAX_TOKENS + 7])
def test_encoded_experts_in_bf16_stay_within_bf16_rounding(tokens):
    source = stored_source("q4_g64_fp16")
    dense, encoded = both_forms(source, range(NUM_EXPERTS), torch.bfloat16)
    experts, weights = route(tokens)
    x = torch.randn(tokens, HIDDEN)
    exact, _ = both_forms(source, range(NUM_EXPERTS))
    reference = exact(x, experts, weights)
    ours = encoded(x.bfloat16(), experts, weights.bfloat16())
    assert ours.dtype == torch.bfloat16
    assert rel_err(ours, reference) < 2e-2
    assert rel_err(ours, dense(x.bfloat16(), experts, weights.bfloat16())) < 2e-2


@pytest.mark.skipif(
    not moe.grouped_mm_runs_on(torch.device("cpu")), reason="torch._grouped_mm has no CPU kernel"
)
@pytest.mark.parametrize("block_bytes", [moe.GROUPED_MM_BYTES, 3 * 2 * WIDTH * HIDDEN * 2])
@pytest.mark.parametrize("held", [range(NUM_EXPERTS), range(2, 5)], ids=["all", "ep-rank"])
@pytest.mark.parametrize("tokens", [GATHERED_MAX_TOKENS + 1, 150])
def test_grouped_matmul_prefill_computes_the_dequantized_experts(
    monkeypatch, held, tokens, block_bytes
):
    """The prefill path CUDA takes in bf16 (pairs sorted by expert, one grouped product per
    block of dequantized experts; here also blocks of 3 experts), run on the CPU: within bf16
    rounding of the exact experts, and on a rank, zero for experts it does not hold."""
    monkeypatch.setattr(moe, "GROUPED_MM_BYTES", block_bytes)
    source = stored_source("q4_g64_fp16")
    _, encoded = both_forms(source, held, torch.bfloat16)
    exact, _ = both_forms(source, held)
    experts, weights = route(tokens)
    x = torch.randn(tokens, HIDDEN)
    ours = encoded._forward_grouped_mm(x.bfloat16(), experts, weights.bfloat16())
    assert ours.dtype == torch.bfloat16
    assert rel_err(ours, exact(x, experts, weights)) < 2e-2
    per_expert = encoded._forward_per_expert(x.bfloat16(), experts, weights.bfloat16())
    assert rel_err(ours, per_expert) < 1e-2


def test_grouped_matmul_prefill_takes_only_16_byte_rows_in_bf16():
    assert moe.grouped_mm_supported(torch.bfloat16, 1024, 2048)
    assert not moe.grouped_mm_supported(torch.float16, 1024, 2048)
    assert not moe.grouped_mm_supported(torch.bfloat16, 1024, 2044)


@pytest.mark.parametrize("tokens", [4, GATHERED_MAX_TOKENS + 1])
def test_expert_parallel_ranks_add_up_to_the_whole_layer(tokens):
    """Each rank adds only its own experts' outputs; choices of the others' add zero."""
    source = stored_source("q4_g64_fp16")
    _, whole = both_forms(source, range(NUM_EXPERTS))
    experts, weights = route(tokens, seed=1)
    x = torch.randn(tokens, HIDDEN)
    parts = [both_forms(source, held)[1](x, experts, weights) for held in (range(4), range(4, 8))]
    torch.testing.assert_close(parts[0] + parts[1], whole(x, experts, weights))
    elsewhere = torch.arange(TOP_K).expand(tokens, TOP_K)  # experts 0..2, all on rank 0
    _, second_rank = both_forms(source, range(4, 8))
    assert torch.equal(second_rank(x, elsewhere, weights), torch.zeros_like(x))


@pytest.mark.parametrize("tokens", [2, GATHERED_MAX_TOKENS + 3])
def test_tied_router_scores_give_the_dequantized_output_in_any_choice_order(tokens):
    """A router with all-zero weights ties every expert: whichever k the top-k picks, and in
    whatever order a token lists them, the outputs are summed in expert id order."""
    source = stored_source("q8_g32_fp16")
    dense, encoded = both_forms(source, range(NUM_EXPERTS))
    layers = []
    for experts_module in (dense, encoded):
        layer = SparseMoE(HIDDEN, NUM_EXPERTS, TOP_K, WIDTH, 32)
        nn.init.zeros_(layer.gate.weight)
        layer.experts = experts_module
        layers.append(layer)
    layers[1].load_state_dict(layers[0].state_dict(), strict=False)
    x = torch.randn(tokens, HIDDEN)
    torch.testing.assert_close(layers[1](x), layers[0](x))
    experts = torch.stack([torch.randperm(NUM_EXPERTS)[:TOP_K] for _ in range(tokens)])
    weights = torch.full((tokens, TOP_K), 1.0 / TOP_K)
    reversed_order = encoded(x, experts.flip(-1), weights)
    assert torch.equal(encoded(x, experts, weights), reversed_order)
    torch.testing.assert_close(reversed_order, dense(x, experts, weights))


def test_only_experts_stored_whole_in_gemv_formats_are_kept_encoded():
    with torch.device("meta"):
        model = nn.Module()
        model.q4 = Experts(range(NUM_EXPERTS), HIDDEN, WIDTH)
        model.q6 = Experts(range(NUM_EXPERTS), HIDDEN, WIDTH)
        model.mixed = Experts(range(NUM_EXPERTS), HIDDEN, WIDTH)
        model.split = Experts(range(NUM_EXPERTS), HIDDEN, WIDTH // 2)  # rows split over ranks
        model.ep = Experts(range(2, 5), HIDDEN, WIDTH)
    stored = {}
    for name, (gate_up, down) in {
        "q4": ("q4_g64_fp16", "q4_g64_fp16"),
        "q6": ("q6_g64_fp16", "q6_g64_fp16"),
        "mixed": ("q4_g64_fp16", "q6_g64_fp16"),
        "split": ("q4_g64_fp16", "q4_g64_fp16"),
        "ep": ("q8_g32_fp16", "q4_g64_fp16"),
    }.items():
        layer = stored_source(gate_up, down).encoded_tensors
        stored[f"x/{name}.gate_up_proj"] = layer["x/moe.experts.gate_up_proj"]
        stored[f"x/{name}.down_proj"] = layer["x/moe.experts.down_proj"]
    replaced = quantize_experts(model, StateDictSource({}, stored), torch.device("cpu"), logical)
    assert replaced == ["q4", "ep"]
    assert all(isinstance(getattr(model, n), Experts) for n in ("q6", "mixed", "split"))
    ep = model.ep
    assert isinstance(ep, GroupwiseExperts) and (ep.first, ep.num_experts) == (2, 3)
    assert ep.gate_up_proj.shape == (3, 2 * WIDTH, HIDDEN)
    assert ep.gate_up_proj_codes.shape == (3, 2 * WIDTH, HIDDEN)  # q8: one byte a code
    assert ep.down_proj_codes.shape == (3, HIDDEN, 64)  # q4: K 96 padded to 128, two a byte
    every_expert = stored["x/ep.gate_up_proj"].planes["scales"].reshape(NUM_EXPERTS, 2 * WIDTH, -1)
    assert torch.equal(ep.gate_up_proj_scales, every_expert[2:5])


def test_a_source_without_encoded_tensors_changes_nothing():
    model = nn.Module()
    model.experts = Experts(range(2), 8, 4)
    assert quantize_experts(model, object(), torch.device("cpu"), str) == []


def test_groupwise_int_moe_artifact_with_encoded_experts_gives_the_dequantized_logits(
    tiny_artifact, monkeypatch
):
    """The artifact's stacked experts (one object each: planes [E * N, ...]) and its q8 MTP
    experts, loaded encoded on the CPU as CUDA would load them: a 100-token prefill (per-expert
    path) and a decode step (grouped path) give the logits of the dequantized load."""
    _, path = tiny_artifact(weights="groupwise-int", moe=True, mtp=True, experts=6, seed=5)
    artifact = Artifact.open(path)
    reference = load_model(artifact, artifact.config())
    monkeypatch.setattr(qwen3_5, "runs_quantized", lambda *args: True)
    encoded = load_model(artifact, artifact.config())
    experts = {n: m for n, m in encoded.named_modules() if isinstance(m, GroupwiseExperts)}
    layers = [f"layers.{i}.mlp.experts" for i in range(4)]
    assert sorted(experts) == [*layers, "mtp.layers.0.mlp.experts"]
    assert experts["layers.0.mlp.experts"].format == "q4_g64_fp16"
    assert experts["mtp.layers.0.mlp.experts"].format == "q8_g32_fp16"
    assert any(isinstance(m, GroupwiseLinear) for m in encoded.modules())
    prompt, following = list(range(0, 300, 3)), [7]
    for model in (reference, encoded):
        runner = Runner(model)
        runner.add("a")
        prefill = runner.step({"a": prompt})["a"]
        decode, mtp = runner.step({"a": following}, mtp_ids={"a": [9]})
        model.outputs = (prefill, decode["a"], mtp["a"])
    for ours, ref in zip(encoded.outputs, reference.outputs):
        assert rel_err(ours, ref) < 1e-5


def test_norm_inside_the_router_gives_the_logits_of_the_norm_then_the_block(
    tiny_artifact, monkeypatch
):
    """The decoder layers' path through `SparseMoE.norm_and_forward` (the GPU's, the norm
    inside the router's kernel), taken on the CPU, where its norm and router are the torch
    references: prefill and decode logits those of the norm and then the block, so the layer
    hands on the block's output and the residual stream as before. (Not bit for bit: the
    fused router's logits are one product over the stacked router and shared gate, which the
    CPU path computes apart.)"""
    _, path = tiny_artifact(weights="groupwise-int", moe=True, experts=6, seed=5)
    artifact = Artifact.open(path)
    monkeypatch.setattr(qwen3_5, "runs_quantized", lambda *args: True)
    calls = []
    fused = moe.moe_norm_router_route
    monkeypatch.setattr(moe, "moe_norm_router_route", lambda *a: calls.append(1) or fused(*a))
    outputs = []
    for inside in (False, True):
        if inside:  # the fused router's weight, which only CUDA half precision gets
            monkeypatch.setattr(
                SparseMoE, "fused_router_weight", lambda s, x: s.router.linear.weight
            )
        model = load_model(artifact, artifact.config())
        runner = Runner(model)
        runner.add("a")
        prefill = runner.step({"a": list(range(0, 30, 3))})["a"]
        decode = runner.step({"a": [7]})["a"]
        outputs.append((prefill, decode))
        assert len(calls) == (8 if inside else 0)  # 4 MoE layers, a prefill and a decode step
    for ours, ref in zip(outputs[1], outputs[0]):
        assert rel_err(ours, ref) < 1e-5
