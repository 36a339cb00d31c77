"""MoE experts kept encoded on the GPU, at the Qwen3.5-35B-A3B expert shapes (hidden 2048,
expert width 512, top-8; 32 of its 256 experts keep memory small): the grouped GEMV and
`GroupwiseExperts` against the dequantized experts in fp64 (relative error of bf16 operands,
METHOD.md), the decode path replayed from a CUDA graph, and a groupwise-int MoE model end to
end (experts encoded, greedy tokens with graphs equal those without, logits near the CPU's).
The routing and output kernels at the full router (256 experts) against their references, and
a whole encoded MoE block replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import check_grouped_groupwise_linear, check_swiglu_combine, relative_error
from test_graphs_gpu import assert_top_logprob_close_to_cpu_fp32, mixed_requests, tokens

from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import load_core
from ninfer.kernels import moe_combine as combine_reference
from ninfer.kernels import moe_router as router_reference
from ninfer.kernels import moe_routing as routing_reference
from ninfer.kernels.x_split import SplitRequest
from ninfer.models.layers import moe
from ninfer.models.layers.linear import GroupwiseLinear
from ninfer.models.layers.moe import GATHERED_MAX_TOKENS, Experts, GroupwiseExperts, SparseMoE
from ninfer.models.layers.norms import RMSNorm
from ninfer.quant import get_format

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16 = torch.bfloat16
HIDDEN, WIDTH, TOP_K, NUM_EXPERTS = 2048, 512, 8, 32
FORMATS = ["q4_g64_fp16", "q8_g32_fp16"]
ROUTER_EXPERTS = 256  # the whole router of 35B-A3B
DECODE_TOKENS = [1, 8, 64]


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(2 * WIDTH, HIDDEN), (HIDDEN, WIDTH)], ids=str)
@pytest.mark.parametrize(("num_tokens", "pairs"), [(1, 8), (1, 9), (8, 64), (64, 512)], ids=str)
def test_grouped_gemv_at_the_35b_a3b_expert_shapes(format_name, n, k, num_tokens, pairs):
    from ninfer.kernels import groupwise_gemv_triton

    torch.manual_seed(0)
    check_grouped_groupwise_linear(
        groupwise_gemv_triton, format_name, NUM_EXPERTS, n, k, num_tokens, pairs, BF16, "cuda", 1e-2
    )


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize("pairs", [9, 72, 576])
def test_swiglu_inside_the_down_product_gives_the_two_kernels_bit_for_bit(format_name, pairs):
    """The experts' down projection with the SwiGLU in its kernel, at the 35B-A3B shapes (K =
    512, 2048 rows; one to 64 tokens of nine pairs, the shared expert's among them), bf16: the
    SwiGLU kernel with the codes, then the grouped product, bit for bit."""
    from ninfer.kernels import groupwise_gemv_triton, swiglu_triton
    from ninfer.kernels.x_split import SplitRequest
    from ninfer.quant import EncodedTensor

    torch.manual_seed(pairs)
    stacked = get_format(format_name).encode(
        torch.randn(NUM_EXPERTS * HIDDEN, WIDTH, device="cuda") * WIDTH**-0.5
    )
    planes = {name: p.reshape(NUM_EXPERTS, HIDDEN, -1) for name, p in stacked.planes.items()}
    weight = EncodedTensor(stacked.format, stacked.layout, (NUM_EXPERTS, HIDDEN, WIDTH), planes)
    assert groupwise_gemv_triton.swiglu_fits(weight)
    # the pair lists first: the product reads them before it waits for the kernel before it,
    # which must not be the one that wrote them (as the routing is two kernels back in a step)
    rows = torch.arange(pairs, device="cuda", dtype=torch.int32)
    ids = torch.randint(0, NUM_EXPERTS, (pairs,), device="cuda", dtype=torch.int32)
    gate_up = torch.randn(pairs, 2 * WIDTH, device="cuda", dtype=BF16) * 2
    fused = groupwise_gemv_triton.grouped_swiglu_linear(gate_up, weight, rows, ids)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = swiglu_triton.silu_mul(gate, up, SplitRequest.for_format(format_name, pairs))
    assert torch.equal(
        fused, groupwise_gemv_triton.grouped_groupwise_linear(hidden, weight, rows, ids)
    )


@pytest.mark.parametrize("format_name", FORMATS)
def test_the_combine_inside_the_down_product_gives_the_two_kernels_bit_for_bit(format_name):
    """One token at the 35B-A3B shapes (top-8 and the shared expert, 2048 rows of K = 512),
    bf16: the down product with the SwiGLU and the MoE combine in its kernel against the
    down product then the combine kernel, bit for bit, three calls over the mailbox it leaves
    at zero."""
    from ninfer.kernels import groupwise_gemv_triton, moe_combine_triton

    torch.manual_seed(1)
    check_swiglu_combine(
        groupwise_gemv_triton,
        moe_combine_triton,
        format_name,
        NUM_EXPERTS,
        HIDDEN,
        WIDTH,
        TOP_K,
        BF16,
        "cuda",
    )


@pytest.fixture(scope="module")
def stored_experts() -> dict:
    """Each format's stacked experts as a converter stores them (planes [E * N, ...])."""
    torch.manual_seed(0)
    gate_up = torch.randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN, device="cuda") * HIDDEN**-0.5
    down = torch.randn(NUM_EXPERTS, HIDDEN, WIDTH, device="cuda") * WIDTH**-0.5
    return {
        name: (get_format(name).encode(gate_up), get_format(name).encode(down)) for name in FORMATS
    }


def dense_experts(stored, held: range, dtype: torch.dtype) -> Experts:
    """The experts of `held` dequantized to `dtype`, as the CPU path loads them."""
    with torch.device("meta"):
        experts = Experts(held, HIDDEN, WIDTH)
    for proj, encoded in zip(("gate_up_proj", "down_proj"), stored):
        weight = encoded.decode(dtype)[held.start : held.stop]
        setattr(experts, proj, torch.nn.Parameter(weight, requires_grad=False))
    return experts


def route(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-8 of scores drawn from four values, so many experts tie; weights renormalised."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randint(0, 4, (num_tokens, NUM_EXPERTS), device="cuda", generator=generator)
    weights, experts = torch.softmax(scores.float(), dim=-1).topk(TOP_K, dim=-1)
    return experts, weights / weights.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize("held", [range(NUM_EXPERTS), range(8, 24)], ids=["all", "ep-rank"])
@pytest.mark.parametrize("num_tokens", [1, 4, GATHERED_MAX_TOKENS, GATHERED_MAX_TOKENS + 1, 300])
def test_encoded_experts_match_the_dequantized_experts(
    stored_experts, format_name, held, num_tokens
):
    """Up to GATHERED_MAX_TOKENS the grouped GEMVs, beyond it the grouped matrix products
    over blocks of dequantized experts; the bf16 dequantized experts are held to the same
    bound."""
    stored = stored_experts[format_name]
    encoded = GroupwiseExperts.from_stored(held, *stored, device="cuda")
    experts, weights = route(num_tokens, seed=num_tokens)
    x = torch.randn(num_tokens, HIDDEN, device="cuda")
    exact = dense_experts(stored, held, torch.float64)(x.double(), experts, weights.double())
    ours = encoded(x.to(BF16), experts, weights.to(BF16))
    assert ours.dtype == BF16 and ours.shape == x.shape
    assert relative_error(ours, exact) < 1e-2
    dense = dense_experts(stored, held, BF16)(x.to(BF16), experts, weights.to(BF16))
    assert relative_error(dense, exact) < 1e-2


def test_grouped_matmul_prefill_runs_on_this_gpu():
    """The prefill path above is the grouped matrix product, not the per-expert fallback."""
    assert moe.grouped_mm_runs_on(torch.device("cuda"))
    assert moe.grouped_mm_supported(BF16, 2 * 512, 2048) and moe.grouped_mm_supported(
        BF16, 2048, 512
    )


def test_encoded_decode_replays_from_a_cuda_graph(stored_experts):
    """No host sync and fixed shapes: the grouped path captures, and a replay on new routing
    gives what an eager call does."""
    encoded = GroupwiseExperts.from_stored(
        range(NUM_EXPERTS), *stored_experts["q4_g64_fp16"], device="cuda"
    )
    num_tokens = 8
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=BF16)
    experts, weights = route(num_tokens, seed=0)
    weights = weights.to(BF16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        encoded(x, experts, weights)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = encoded(x, experts, weights)
    for seed in (1, 2):
        new_experts, new_weights = route(num_tokens, seed)
        x.copy_(torch.randn_like(x))
        experts.copy_(new_experts)
        weights.copy_(new_weights)
        graph.replay()
        assert torch.equal(out, encoded(x, experts, weights))


def test_quantized_moe_model_keeps_experts_encoded_and_graphs_agree(tiny_artifact):
    _, path = tiny_artifact(weights="groupwise-int", moe=True, hidden=128)
    core = load_core(path, EngineConfig(device="cuda", dtype="bfloat16", cuda_graph=False))
    experts = [m for m in core.runner.model.modules() if isinstance(m, GroupwiseExperts)]
    assert len(experts) == 4 and all(m.gate_up_proj_codes.is_cuda for m in experts)
    assert not any(isinstance(m, Experts) for m in core.runner.model.modules())
    # the shared experts are stored like the routed ones (q4, same width): stacked with them
    assert all(m.shared_local == m.num_experts for m in experts)
    requests = mixed_requests(7, 8, vocab=512)
    fields = dict(max_context=512, max_concurrency=4, prefill_chunk=128)
    assert tokens(path, requests, cuda_graph=True, **fields) == tokens(
        path, requests, cuda_graph=False, **fields
    )


def test_quantized_moe_model_logits_close_to_the_dequantized_model(tiny_artifact):
    """The same q4 MoE artifact: encoded experts and linears in bf16 on the GPU vs everything
    dequantized in fp32 on the CPU."""
    _, path = tiny_artifact(weights="groupwise-int", moe=True, hidden=128)
    assert_top_logprob_close_to_cpu_fp32(path, list(range(20, 100)))


@pytest.mark.parametrize(
    ("first", "count"), [(0, ROUTER_EXPERTS), (64, 32)], ids=["all", "ep-rank"]
)
@pytest.mark.parametrize("num_tokens", DECODE_TOKENS)
def test_routing_kernel_matches_the_reference(num_tokens, first, count):
    """bf16 logits read from a stacked router product (strided rows); experts and pair lists
    exact, weights within one bf16 rounding step (eps relative)."""
    from ninfer.kernels import moe_routing_triton

    stacked = torch.randn(num_tokens, ROUTER_EXPERTS + 1, device="cuda").to(BF16)
    logits = stacked[:, :ROUTER_EXPERTS]
    ours = moe_routing_triton.moe_route(logits, TOP_K, BF16, first, count)
    ref = routing_reference.moe_route(logits, TOP_K, BF16, first, count)
    for name in ("experts", "pair_tokens", "pair_experts", "pairs"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    torch.testing.assert_close(ours.weights, ref.weights, rtol=torch.finfo(BF16).eps, atol=0)


@pytest.mark.parametrize("num_tokens", DECODE_TOKENS)
def test_routing_kernel_breaks_ties_as_torch_topk_does(num_tokens):
    """Scores of four values tie many experts at the k-th place: torch.topk on CUDA keeps the
    lowest ids of those, and so does the kernel."""
    from ninfer.kernels import moe_routing_triton

    generator = torch.Generator(device="cuda").manual_seed(num_tokens)
    scores = torch.randint(0, 4, (num_tokens, ROUTER_EXPERTS), device="cuda", generator=generator)
    logits = scores.to(BF16)
    ours = moe_routing_triton.moe_route(logits, TOP_K, BF16, 0, ROUTER_EXPERTS)
    ref = routing_reference.moe_route(logits, TOP_K, BF16, 0, ROUTER_EXPERTS)
    assert torch.equal(ours.experts, ref.experts)
    torch.testing.assert_close(ours.weights, ref.weights, rtol=torch.finfo(BF16).eps, atol=0)


@pytest.mark.parametrize(
    ("first", "count"), [(0, ROUTER_EXPERTS), (64, 32)], ids=["all", "ep-rank"]
)
@pytest.mark.parametrize("num_tokens", DECODE_TOKENS)
def test_combine_kernel_matches_the_reference(num_tokens, first, count):
    """The eager roundings in bf16: equal but where the sigmoid rounds differently."""
    from ninfer.kernels import moe_combine_triton

    routes = routing_reference.moe_route(
        torch.randn(num_tokens, ROUTER_EXPERTS, device="cuda"), TOP_K, BF16, first, count
    )
    inputs = dict(
        choices=torch.randn(num_tokens, TOP_K, HIDDEN, device="cuda").to(BF16),
        weights=routes.weights,
        experts=routes.experts,
        first=first,
        count=count,
        shared=torch.randn(num_tokens, HIDDEN, device="cuda").to(BF16),
        shared_gate=torch.randn(num_tokens, ROUTER_EXPERTS + 1, device="cuda").to(BF16)[:, -1:],
    )
    ours = moe_combine_triton.moe_combine(**inputs)
    ref = combine_reference.moe_combine(**inputs)
    assert ours.dtype == BF16 and ours.shape == (num_tokens, HIDDEN)
    assert (ours == ref).float().mean() > 0.99
    assert relative_error(ours, ref) < 2**-8


@pytest.mark.parametrize("stack_shared", [False, True], ids=["shared-apart", "shared-stacked"])
def test_encoded_moe_block_decode_replays_from_a_cuda_graph(
    stored_experts, monkeypatch, stack_shared
):
    """A whole block (stacked router, encoded experts and shared expert, the shared expert
    apart or stacked with the routed ones) at 8 tokens: captured once, a replay on new inputs
    gives the eager result, which is within bf16 rounding of the same block with routing and
    output computed by the torch references."""
    torch.manual_seed(0)
    block = encoded_block(stored_experts, stack_shared)
    x = torch.randn(8, HIDDEN, device="cuda", dtype=BF16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        block(x)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        eager = block(x)
        assert torch.equal(out, eager)
        with monkeypatch.context() as references:
            references.setattr(moe, "moe_router_route", router_reference.moe_router_route)
            references.setattr(moe, "moe_route", routing_reference.moe_route)
            references.setattr(moe, "moe_combine", combine_reference.moe_combine)
            assert relative_error(eager, block(x)) < 1e-2


def encoded_block(stored_experts, stack_shared: bool) -> SparseMoE:
    """A bf16 block with the router stacked, q4 experts and shared expert encoded, the shared
    expert apart or stacked with the routed ones."""
    q4 = get_format("q4_g64_fp16")
    block = SparseMoE(HIDDEN, NUM_EXPERTS, TOP_K, WIDTH, WIDTH).to("cuda")
    for param in block.parameters():
        torch.nn.init.normal_(param, std=HIDDEN**-0.5)
    block.experts = GroupwiseExperts.from_stored(
        range(NUM_EXPERTS), *stored_experts["q4_g64_fp16"], device="cuda"
    )
    for proj in ("gate_proj", "up_proj", "down_proj"):
        weight = getattr(block.shared_expert, proj).weight.data
        setattr(block.shared_expert, proj, GroupwiseLinear(q4.encode(weight)))
    block.shared_expert.fuse_projections()
    block = block.to(BF16)
    assert block.fuse_projections() == ["router"]
    if stack_shared:
        assert block.stack_shared_expert()
    return block


@pytest.mark.parametrize("stack_shared", [False, True], ids=["shared-apart", "shared-stacked"])
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_norm_inside_the_router_is_the_norm_then_the_block(
    stored_experts, stack_shared, num_tokens
):
    """`SparseMoE.norm_and_forward` (the norm before the block inside the router's kernel, the
    experts' codes written by it) against the norm kernel, then the block: the same residual
    sum, the output within bf16 rounding (a normed value may differ in its last bit)."""
    torch.manual_seed(num_tokens)
    block = encoded_block(stored_experts, stack_shared)
    norm = RMSNorm(HIDDEN, 1e-6).to("cuda", BF16)
    torch.nn.init.normal_(norm.weight, std=0.1)
    norm.split_request = SplitRequest.for_format("q4_g64_fp16", GATHERED_MAX_TOKENS)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=BF16) * 2
    residual = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=BF16)
    fused = block.norm_and_forward(x, residual, norm)
    assert fused is not None
    out, total = fused
    normed, ref_total = norm(x, residual)
    ref = block(normed)
    assert torch.equal(total, ref_total)
    assert out.dtype == BF16 and out.shape == x.shape
    assert relative_error(out, ref) < 1e-2
