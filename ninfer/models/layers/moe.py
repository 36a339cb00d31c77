"""Qwen3.5 sparse MoE: fp32 softmax over all experts, top-k, renormalise, cast to the model
dtype; SwiGLU experts stored stacked (`gate_up_proj` [E, 2I, H] gate rows first, `down_proj`
[E, H, I]); plus a shared SwiGLU expert scaled by sigmoid(x . w_shared_gate).
With expert parallelism a rank holds a contiguous block of the experts and adds only theirs.

`Experts` holds dense weights (the CPU reference path). On CUDA in half precision, experts
stored in a group-wise int format stay encoded (`GroupwiseExperts`, swapped in at load by
`quantize_experts`): decode reads only the chosen experts' codes, which is where a MoE decode
step's time goes; prefill in bf16 sorts the (token, choice) pairs by expert and runs each
projection as one grouped matrix product (`torch._grouped_mm`) per block of dequantized
experts, where the per-expert loop would launch a dequantization and products per expert.

A decode step is launch-bound, so on CUDA the routing (softmax, top-k, renormalise, the pair
lists) and the output (weighted choices, shared expert gate, sums) are one Triton kernel each
(`moe_routing_triton`, `moe_combine_triton`), and with the dense router stacked with the
shared expert's gate, the router product and the routing are one (`moe_router_triton`);
elsewhere their torch references run, which compute what the eager module always has, bit for
bit. Where the shared expert is kept encoded like the routed ones, it is stacked after them at
load (`SparseMoE.stack_shared_expert`) and a one-token decode step runs it as one more pair of
the two grouped GEMVs: a block is five launches (router product and routing, two grouped GEMVs
and their activation, the output) instead of eight (`SHARED_PAIRS_MAX_TOKENS`). On CUDA the
output then runs inside the second grouped GEMV (`grouped_swiglu_combine`), one launch fewer.
The decoder layer's norm before the block runs inside the router's kernel where that kernel
runs (`SparseMoE.norm_and_forward`), one launch fewer again."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.errors import ArtifactError
from ninfer.kernels.dispatch import (
    grouped_groupwise_linear,
    grouped_swiglu_combine,
    grouped_swiglu_linear,
    groupwise_dequant,
    moe_combine,
    moe_norm_router_route,
    moe_route,
    moe_router_route,
    silu_mul,
)
from ninfer.kernels.x_split import SplitRequest
from ninfer.models.layers.linear import (
    GEMV_FORMATS,
    FusedLinear,
    GroupwiseLinear,
    encoded_linear,
    fuse_into,
)
from ninfer.models.layers.mlp import MLP
from ninfer.models.layers.norms import RMSNorm
from ninfer.quant import EncodedTensor

# Tokens up to this many take the gathered (graph-safe) expert path on the GPU.
GATHERED_MAX_TOKENS = 64
# Up to this many tokens a stacked shared expert runs as one more pair per token of the grouped
# GEMVs (one launch for all); over more, as a GEMV over the tokens' rows, which reads its
# weights once where pairs read them once per token. Where the two cross is not measured yet;
# at one token they read the same.
SHARED_PAIRS_MAX_TOKENS = 1
# The norm before a MoE block inside the fused router's kernel (`SparseMoE.norm_and_forward`):
# one launch fewer per MoE layer of a decode step. Each router program norms the row itself
# for its dots, reading it from L2 while its router row comes from memory (the 35B-A3B C=1
# step 1.84 -> 1.79-1.80 ms on the H200, docs/performance.md, Measurement 17).
NORM_IN_ROUTER = True
# Encoded experts over more tokens on CUDA in bf16: dequantized this many bytes of experts at a
# time for one grouped matrix product over their tokens (bounds the transient dense weight).
GROUPED_MM_BYTES = 256 << 20


def _sorted_routes(
    experts: torch.Tensor, weights: torch.Tensor, first: int, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's k choices in expert id order (the order the per-expert loop adds them):
    (local expert ids clamped into range, their weights, whether this rank holds them)."""
    experts, order = experts.sort(dim=-1)
    weights = weights.gather(1, order)
    local = experts - first
    held = (local >= 0) & (local < count)
    return local.clamp(0, count - 1), weights, held


class RoutedExperts(nn.Module):
    """What both expert forms share: the held range and the per-expert loop of prefill."""

    first: int  # global id of local expert 0
    num_experts: int  # experts this rank holds

    def expert_mlp(self, local: int, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU of local expert `local` over the rows of x."""
        raise NotImplementedError

    def _forward_per_expert(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Experts present in the batch one at a time, in id order (reads the ids on the host)."""
        out = torch.zeros_like(x)
        held = range(self.first, self.first + self.num_experts)
        for expert in experts.unique().tolist():
            if expert not in held:
                continue
            token, choice = (experts == expert).nonzero(as_tuple=True)
            y = self.expert_mlp(expert - self.first, x[token])
            out.index_add_(0, token, y * weights[token, choice, None])
        return out


class Experts(RoutedExperts):
    def __init__(self, experts: range, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.first = experts.start
        self.num_experts = len(experts)
        self.gate_up_proj = nn.Parameter(
            torch.empty(self.num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(self.num_experts, hidden_size, intermediate_size), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H]; experts, weights [T, k]. Sums the weighted expert outputs in the model
        dtype, expert by expert in id order, as the transformers reference does."""
        if x.is_cuda and x.shape[0] <= GATHERED_MAX_TOKENS:
            return self._forward_gathered(x, experts, weights)
        return self._forward_per_expert(x, experts, weights)

    def expert_mlp(self, local: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[local]).chunk(2, dim=-1)
        return F.linear(silu_mul(gate, up), self.down_proj[local])

    def _forward_gathered(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Decode-sized batches on the GPU: no host sync and fixed shapes (CUDA-graph safe).
        Each token's k chosen experts are taken in id order (the order `_forward_per_expert` adds
        them), their weights gathered per token and applied as batched matrix-vector products."""
        local, weights, held = _sorted_routes(experts, weights, self.first, self.num_experts)
        out = torch.zeros_like(x)
        for choice in range(local.shape[1]):
            index = local[:, choice]
            gate, up = torch.bmm(self.gate_up_proj[index], x[:, :, None])[..., 0].chunk(2, dim=-1)
            y = torch.bmm(self.down_proj[index], silu_mul(gate, up)[:, :, None])[..., 0]
            y = y * weights[:, choice, None]
            out = out + torch.where(held[:, choice, None], y, torch.zeros_like(y))
        return out


class GroupwiseExperts(RoutedExperts):
    """The held experts in their stored group-wise int form (`q4_g64_fp16`, `q8_g32_fp16`):
    planes [E, N, ...] per projection. Up to `GATHERED_MAX_TOKENS` tokens run two grouped
    GEMVs over all (token, choice) pairs, which read each chosen expert's codes once per pair
    and dequantize in registers (no host sync, fixed shapes: CUDA-graph safe); more tokens loop
    over the experts present, each through the GEMV or a dequantized matmul (`encoded_linear`)."""

    def __init__(self, experts: range, gate_up: EncodedTensor, down: EncodedTensor) -> None:
        super().__init__()
        self.first = experts.start
        self.num_experts = len(experts)
        # local index of the shared expert once stacked after the held ones (`stack_shared`)
        self.shared_local: int | None = None
        # the integer-GEMV codes the grouped down GEMV wants beside its input
        self.down_split: SplitRequest | None = None
        self.plane_names: dict[str, tuple[str, ...]] = {}
        self.stored_as: dict[str, tuple[str, str, tuple[int, ...]]] = {}
        for proj, encoded in (("gate_up_proj", gate_up), ("down_proj", down)):
            if len(encoded.shape) != 3 or encoded.shape[0] != self.num_experts:
                raise ValueError(
                    f"{proj}: expected {self.num_experts} stacked experts, got shape {encoded.shape}"
                )
            count, rows, _ = encoded.shape
            self.stored_as[proj] = (encoded.format, encoded.layout, tuple(encoded.shape))
            self.plane_names[proj] = tuple(encoded.planes)
            for name, plane in encoded.planes.items():
                # planes may come as stored, [E * N, ...] (rows of the flattened tensor)
                self.register_buffer(
                    f"{proj}_{name}", plane.reshape(count, rows, -1), persistent=False
                )

    @classmethod
    def from_stored(
        cls,
        held: range,
        gate_up: EncodedTensor,
        down: EncodedTensor,
        device: torch.device | str = "cpu",
    ) -> GroupwiseExperts:
        """From the stored stacked tensors of every expert (`gate_up_proj` [E, 2I, H],
        `down_proj` [E, H, I], planes [E * N, ...] as an artifact holds them): only the
        experts in `held` are copied to `device`."""

        def held_planes(stored: EncodedTensor) -> EncodedTensor:
            count, rows, k = stored.shape
            # copied even where the stored planes are already on `device` (the bench's random
            # weights): a view would keep every expert alive
            planes = {
                name: plane.reshape(count, rows, -1)[held.start : held.stop].to(device, copy=True)
                for name, plane in stored.planes.items()
            }
            return EncodedTensor(stored.format, stored.layout, (len(held), rows, k), planes)

        return cls(held, held_planes(gate_up), held_planes(down))

    def stack_shared(self, gate_up: EncodedTensor, down: EncodedTensor) -> bool:
        """Stack a shared SwiGLU expert (`gate_up` [2I, H], `down` [H, I]) after the held
        experts, as local expert `num_experts`, where it is stored like them (format, layout,
        planes, shapes): a decode step then runs it as one more (token, expert) pair of the
        grouped GEMVs instead of two GEMVs and an activation of its own. Returns whether it
        was stacked. The planes are copied one at a time, so loading holds at most one plane
        of one layer twice."""
        if self.shared_local is not None:
            return False
        for proj, encoded in (("gate_up_proj", gate_up), ("down_proj", down)):
            fmt, layout, shape = self.stored_as[proj]
            if (encoded.format, encoded.layout, tuple(encoded.shape)) != (fmt, layout, shape[1:]):
                return False
            if tuple(encoded.planes) != self.plane_names[proj]:
                return False
        for proj, encoded in (("gate_up_proj", gate_up), ("down_proj", down)):
            fmt, layout, (count, rows, k) = self.stored_as[proj]
            for name, plane in encoded.planes.items():
                stacked = getattr(self, f"{proj}_{name}")
                shared = plane.to(stacked.device).reshape(1, rows, -1)
                self.register_buffer(
                    f"{proj}_{name}", torch.cat([stacked, shared]), persistent=False
                )
            self.stored_as[proj] = (fmt, layout, (count + 1, rows, k))
        self.shared_local = self.num_experts
        return True

    @property
    def format(self) -> str:
        return self.stored_as["gate_up_proj"][0]

    @property
    def gate_up_proj(self) -> EncodedTensor:
        """The stacked form the grouped GEMV reads: shape [E, 2I, H], planes [E, 2I, ...]."""
        return self._encoded("gate_up_proj")

    @property
    def down_proj(self) -> EncodedTensor:
        return self._encoded("down_proj")

    def _encoded(self, proj: str, local: int | None = None) -> EncodedTensor:
        """The stacked experts of `proj`, or local expert `local`'s [N, K] weight alone."""
        fmt, layout, shape = self.stored_as[proj]
        planes = {name: getattr(self, f"{proj}_{name}") for name in self.plane_names[proj]}
        if local is None:
            return EncodedTensor(fmt, layout, shape, planes)
        return EncodedTensor(
            fmt, layout, shape[1:], {name: plane[local] for name, plane in planes.items()}
        )

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H]; experts, weights [T, k]. Sums the weighted expert outputs in the model
        dtype in expert id order, as `Experts` does."""
        if x.shape[0] <= GATHERED_MAX_TOKENS:
            return self._forward_grouped(x, experts, weights)
        if (
            x.is_cuda
            and all(
                grouped_mm_supported(x.dtype, *shape[1:]) for _, _, shape in self.stored_as.values()
            )
            and grouped_mm_runs_on(x.device)
        ):
            return self._forward_grouped_mm(x, experts, weights)
        return self._forward_per_expert(x, experts, weights)

    def expert_mlp(self, local: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = encoded_linear(x, self._encoded("gate_up_proj", local)).chunk(2, dim=-1)
        return encoded_linear(silu_mul(gate, up), self._encoded("down_proj", local))

    def _forward_grouped(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        local, weights, held = _sorted_routes(experts, weights, self.first, self.num_experts)
        tokens, top_k = local.shape
        pairs = torch.arange(tokens * top_k, device=x.device)  # token t's c-th choice: t * k + c
        y = self.pair_outputs(x, pairs // top_k, local.reshape(-1), pairs)
        return _weighted_choices(y.view(tokens, top_k, y.shape[-1]), weights, held)

    def pair_outputs(
        self,
        x: torch.Tensor,
        pair_tokens: torch.Tensor,
        pair_experts: torch.Tensor,
        pairs: torch.Tensor,
    ) -> torch.Tensor:
        """[P, H]: row p is local expert pair_experts[p]'s SwiGLU of x[pair_tokens[p]] (`pairs`
        is 0..P-1, the rows the down projection reads). Two grouped GEMVs, the activation in
        the second where its kernel takes it (`grouped_swiglu_linear`)."""
        gate_up = grouped_groupwise_linear(x, self.gate_up_proj, pair_tokens, pair_experts)
        return grouped_swiglu_linear(gate_up, self.down_proj, pairs, pair_experts, self.down_split)

    def combined_output(self, x: torch.Tensor, routes, shared_gate: torch.Tensor) -> torch.Tensor:
        """One token's block output [1, H] where its shared expert is its last pair: the
        gate|up product over the pairs, then the down product and the combine, one kernel on
        CUDA where it takes them (`grouped_swiglu_combine`)."""
        gate_up = grouped_groupwise_linear(
            x, self.gate_up_proj, routes.pair_tokens, routes.pair_experts
        )
        return grouped_swiglu_combine(
            gate_up, self.down_proj, routes, self.first, self.num_experts, shared_gate,
            self.down_split,
        )  # fmt: skip

    def _forward_grouped_mm(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Prefill-sized batches: the (token, choice) pairs sorted by expert, each projection
        one grouped matrix product per block of dequantized experts (`torch._grouped_mm`)
        instead of two products and a dequantization per expert present; the choices are then
        added per token in expert id order, as on the other paths. One host sync (the block
        boundaries)."""
        local, weights, held = _sorted_routes(experts, weights, self.first, self.num_experts)
        tokens, top_k = local.shape
        # pairs of experts this rank does not hold sort last, past every block
        key = torch.where(held, local, self.num_experts).reshape(-1)
        order = torch.argsort(key, stable=True)
        ends = torch.bincount(key, minlength=self.num_experts + 1)[:-1].cumsum(0)
        ends_on_host = [0] + ends.tolist()
        ends = ends.to(torch.int32)
        # every [pairs, width] temporary is dropped as soon as it is used: at a 4096-token
        # chunk of 35B-A3B each is 64-128 MiB
        x_sorted = x[order // top_k]
        gate_up = self._grouped_product(x_sorted, "gate_up_proj", ends, ends_on_host)
        del x_sorted
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = silu_mul(gate, up)
        del gate_up, gate, up
        y_sorted = self._grouped_product(hidden, "down_proj", ends, ends_on_host)
        del hidden
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
        del y_sorted
        return _weighted_choices(y.view(tokens, top_k, y.shape[-1]), weights, held)

    def _grouped_product(
        self, rows: torch.Tensor, proj: str, ends: torch.Tensor, ends_on_host: list[int]
    ) -> torch.Tensor:
        """rows [P, K] sorted by expert (expert e's rows end at ends[e]) times each expert's
        `proj` weight: [P, N]. Rows past the last held expert's are left unset."""
        stacked = self._encoded(proj)
        _, n, k = stacked.shape
        count = self.num_experts  # a stacked shared expert is not routed
        block = max(1, GROUPED_MM_BYTES // (n * k * rows.element_size()))
        whole = block >= count and ends_on_host[count] == rows.shape[0] > 0
        out = None if whole else torch.empty(rows.shape[0], n, dtype=rows.dtype, device=rows.device)
        for first in range(0, count, block):
            last = min(first + block, count)
            start, stop = ends_on_host[first], ends_on_host[last]
            if stop == start:
                continue
            planes = {
                name: p[first:last].reshape((last - first) * n, -1)
                for name, p in stacked.planes.items()
            }
            dense = groupwise_dequant(
                EncodedTensor(stacked.format, stacked.layout, ((last - first) * n, k), planes),
                rows.dtype,
            ).view(last - first, n, k)
            product = torch._grouped_mm(
                rows[start:stop], dense.transpose(1, 2), offs=ends[first:last] - start
            )
            if whole:
                return product  # one block over every row: no copy
            out[start:stop] = product
        return out

    def extra_repr(self) -> str:
        shared = ", shared expert stacked" if self.shared_local is not None else ""
        return (
            f"experts={self.first}..{self.first + self.num_experts - 1}, format={self.format}"
            + shared
        )


def _weighted_choices(y: torch.Tensor, weights: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """y [T, k, H], each token's choices in expert id order -> [T, H]: weighted, zero for other
    ranks' experts, added one choice at a time in the model dtype, as `Experts` adds them."""
    y = y * weights[:, :, None]
    y.masked_fill_(~held[:, :, None], 0)
    out = y[:, 0]
    for choice in range(1, y.shape[1]):
        out = out + y[:, choice]
    return out


def grouped_mm_supported(dtype: torch.dtype, rows: int, k: int) -> bool:
    """Whether `torch._grouped_mm` takes these products: bf16 with both widths a multiple of
    8 (16-byte rows) in a torch that has it."""
    return hasattr(torch, "_grouped_mm") and dtype == torch.bfloat16 and rows % 8 == 0 == k % 8


@functools.cache
def grouped_mm_runs_on(device: torch.device) -> bool:
    """One tiny grouped product on `device`, once: builds of torch without the kernel for this
    GPU raise, and the per-expert loop then serves instead."""
    x = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
    w = torch.ones(2, 16, 16, dtype=torch.bfloat16, device=device)
    try:
        out = torch._grouped_mm(
            x, w.transpose(1, 2), offs=torch.tensor([8, 16], dtype=torch.int32, device=device)
        )
    except (RuntimeError, NotImplementedError):
        return False
    return bool((out == 16).all())


def quantize_experts(model: nn.Module, source, device: torch.device, to_logical) -> list[str]:
    """Replace every `Experts` of `model` (built on the meta device) whose `gate_up_proj` and
    `down_proj` `source.encoded(name)` stores in GEMV formats by a `GroupwiseExperts` holding
    this rank's experts' planes on `device`. `to_logical` maps a parameter name to its logical
    tensor name. Experts whose rows are split over ranks stay as they are. Returns the
    replaced modules' names."""
    encoded_of = getattr(source, "encoded", None)
    if encoded_of is None:
        return []
    replaced = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, Experts):
            continue
        stored = {}
        for proj in ("gate_up_proj", "down_proj"):
            try:
                stored[proj] = encoded_of(to_logical(f"{name}.{proj}"))
            except (KeyError, ArtifactError):
                break  # not stored as one object (parts), or not in the source
        if len(stored) < 2:
            continue
        held = range(module.first, module.first + module.num_experts)
        if not all(
            encoded.format in GEMV_FORMATS
            and len(encoded.shape) == 3
            and held.stop <= encoded.shape[0]
            and tuple(encoded.shape[1:]) == tuple(getattr(module, proj).shape[1:])
            for proj, encoded in stored.items()
        ):
            continue
        layer = GroupwiseExperts.from_stored(
            held, stored["gate_up_proj"], stored["down_proj"], device
        )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
        replaced.append(name)
    return replaced


class SparseMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_intermediate_size: int,
        held_experts: range | None = None,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        held = range(num_experts) if held_experts is None else held_experts
        self.experts = Experts(held, hidden_size, intermediate_size)
        self.shared_expert = MLP(hidden_size, shared_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.router: FusedLinear | None = None

    def fuse_projections(self) -> list[str]:
        """The router and the shared expert's gate read the same x: one product for both where
        their weights allow (`fuse_into`); returns the fused modules' names."""
        return ["router"] if fuse_into(self, "router", ("gate", "shared_expert_gate")) else []

    def stack_shared_expert(self) -> bool:
        """Where the experts and the shared expert are kept encoded alike (one GPU, half
        precision, one stored format), stack the shared expert after the routed ones
        (`GroupwiseExperts.stack_shared`) and drop its own module. Runs after
        `fuse_projections` (the shared expert's gate and up must be one linear)."""
        experts, shared = self.experts, getattr(self, "shared_expert", None)
        if not isinstance(experts, GroupwiseExperts) or shared is None:
            return False
        gate_up, down = shared.gate_up_proj, shared.down_proj
        if not (
            isinstance(gate_up, FusedLinear)
            and isinstance(gate_up.linear, GroupwiseLinear)
            and isinstance(down, GroupwiseLinear)
        ):
            return False
        if not experts.stack_shared(gate_up.linear.encoded, down.encoded):
            return False
        del self.shared_expert
        return True

    def router_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routed experts' logits [T, E], shared expert's gate logit [T, 1])."""
        if self.router is None:
            return self.gate(x), self.shared_expert_gate(x)
        return self.router(x)

    def fused_router_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The stacked router and shared-gate weight where the decode step computes the router
        product and the routing in one kernel (`moe_router_route`): off the CPU, whose
        reference path stays as it is, with the router dense in x's half-precision dtype."""
        router = self.router
        if router is None or x.device.type == "cpu" or type(router.linear) is not nn.Linear:
            return None
        weight = router.linear.weight
        half = x.dtype in (torch.bfloat16, torch.float16)
        return weight if half and weight.dtype == x.dtype else None

    def norm_and_forward(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`forward(y)` and the residual stream, where (y, x + residual) = norm(x, residual),
        with the norm inside the router's kernel (`moe_norm_router_route`) where the block
        takes the gathered path with the fused router (`NORM_IN_ROUTER`); else None, and the
        caller runs the norm, then `forward`."""
        experts = self.experts
        if not (
            NORM_IN_ROUTER
            and isinstance(experts, GroupwiseExperts)
            and x.shape[0] <= GATHERED_MAX_TOKENS
            and residual.shape == x.shape
        ):
            return None
        router_weight = self.fused_router_weight(x)
        if router_weight is None:
            return None
        in_pairs = self._shared_in_pairs(x.shape[0])
        num_experts = self.router.split_sizes[0]
        routes, logits, normed, total = moe_norm_router_route(
            x,
            residual,
            norm.weight,
            norm.eps,
            router_weight,
            num_experts,
            self.top_k,
            experts.first,
            experts.num_experts,
            in_pairs,
            norm.split_request,
        )
        return self._gathered(normed, routes, logits[:, num_experts:], in_pairs), total

    def _shared_in_pairs(self, tokens: int) -> bool:
        stacked = getattr(self.experts, "shared_local", None)
        return stacked is not None and tokens <= SHARED_PAIRS_MAX_TOKENS

    def _gathered(
        self, x: torch.Tensor, routes, shared_gate: torch.Tensor, in_pairs: bool
    ) -> torch.Tensor:
        """The block's output from its routes: the chosen experts' products over the pair
        lists (the stacked shared expert's too, `in_pairs`), then `moe_combine` (at one token
        with the shared expert in the pairs, inside the down product where it can:
        `GroupwiseExperts.combined_output`)."""
        experts = self.experts
        stacked = getattr(experts, "shared_local", None)
        tokens = x.shape[0]
        if in_pairs and tokens == 1:
            return experts.combined_output(x, routes, shared_gate)
        outputs = experts.pair_outputs(x, routes.pair_tokens, routes.pair_experts, routes.pairs)
        routed = tokens * self.top_k
        if in_pairs:
            shared = outputs[routed:]  # the pairs of the stacked shared expert
        elif stacked is not None:
            shared = experts.expert_mlp(stacked, x)
        else:
            shared = self.shared_expert(x)
        return moe_combine(
            outputs[:routed].view(tokens, self.top_k, x.shape[1]),
            routes.weights,
            routes.experts,
            experts.first,
            experts.num_experts,
            shared,
            shared_gate,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        stacked = getattr(experts, "shared_local", None)
        tokens = x.shape[0]
        if isinstance(experts, GroupwiseExperts) and tokens <= GATHERED_MAX_TOKENS:
            in_pairs = self._shared_in_pairs(tokens)
            first, count = experts.first, experts.num_experts
            router_weight = self.fused_router_weight(x)
            if router_weight is not None:
                num_experts = self.router.split_sizes[0]
                routes, logits = moe_router_route(
                    x, router_weight, num_experts, self.top_k, first, count, in_pairs
                )
                shared_gate = logits[:, num_experts:]
            else:
                logits, shared_gate = self.router_logits(x)
                routes = moe_route(logits, self.top_k, x.dtype, first, count, in_pairs)
            return self._gathered(x, routes, shared_gate, in_pairs)
        logits, shared_gate = self.router_logits(x)
        routes = moe_route(logits, self.top_k, x.dtype, experts.first, experts.num_experts)
        if stacked is not None:
            shared = experts.expert_mlp(stacked, x)
        else:
            shared = self.shared_expert(x)
        routed = experts(x, routes.experts, routes.weights)
        return routed + torch.sigmoid(shared_gate) * shared
