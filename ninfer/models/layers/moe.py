"""Qwen3.5 sparse MoE: fp32 softmax over all experts, top-k, renormalise, cast to the model
dtype; SwiGLU experts stored stacked (`gate_up_proj` [E, 2I, H] gate rows first, `down_proj`
[E, H, I]); plus a shared SwiGLU expert scaled by sigmoid(x . w_shared_gate).
With expert parallelism a rank holds a contiguous block of the experts and adds only theirs."""

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.kernels.dispatch import silu_mul
from ninfer.models.layers.mlp import MLP

# Tokens up to this many take the gathered (graph-safe) expert path on the GPU.
GATHERED_MAX_TOKENS = 64


class Experts(nn.Module):
    def __init__(self, experts: range, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.first = experts.start  # global id of local expert 0
        num_experts = len(experts)
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H]; experts, weights [T, k]. Sums the weighted expert outputs in the model
        dtype, expert by expert in id order, as the transformers reference does."""
        if x.is_cuda and x.shape[0] <= GATHERED_MAX_TOKENS:
            return self._forward_gathered(x, experts, weights)
        out = torch.zeros_like(x)
        held = range(self.first, self.first + self.gate_up_proj.shape[0])
        for expert in experts.unique().tolist():
            if expert not in held:
                continue
            token, choice = (experts == expert).nonzero(as_tuple=True)
            local = expert - self.first
            gate, up = F.linear(x[token], self.gate_up_proj[local]).chunk(2, dim=-1)
            y = F.linear(silu_mul(gate, up), self.down_proj[local])
            out.index_add_(0, token, y * weights[token, choice, None])
        return out

    def _forward_gathered(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Decode-sized batches on the GPU: no host sync and fixed shapes (CUDA-graph safe).
        Each token's k chosen experts are taken in id order (the order the loop above adds
        them), their weights gathered per token and applied as batched matrix-vector products."""
        count = self.gate_up_proj.shape[0]
        experts, order = experts.sort(dim=-1)
        weights = weights.gather(1, order)
        local = experts - self.first
        held = (local >= 0) & (local < count)
        local = local.clamp(0, count - 1)
        out = torch.zeros_like(x)
        for choice in range(experts.shape[1]):
            index = local[:, choice]
            gate, up = torch.bmm(self.gate_up_proj[index], x[:, :, None])[..., 0].chunk(2, dim=-1)
            y = torch.bmm(self.down_proj[index], silu_mul(gate, up)[:, :, None])[..., 0]
            y = y * weights[:, choice, None]
            out = out + torch.where(held[:, choice, None], y, torch.zeros_like(y))
        return out


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        routed = self.experts(x, experts, weights)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
