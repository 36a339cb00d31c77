"""SwiGLU MLP: down(silu(gate(x)) * up(x)). After loading, `fuse_projections` runs gate_proj
and up_proj as one linear (the names load the weights); where that linear stays encoded and
the kernel takes it, the SwiGLU runs in the product's epilogue (`dispatch.swiglu_linear`)."""

import torch
from torch import nn

from ninfer.kernels.dispatch import silu_mul, swiglu_linear, takes_swiglu_linear
from ninfer.kernels.norm_fold import NormAfter, NormedRows
from ninfer.kernels.x_split import SplitRequest
from ninfer.models.layers.linear import FusedLinear, GroupwiseLinear, fuse_into, linear_then_norm


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: FusedLinear | None = None
        # the integer-GEMV codes down_proj wants beside its input (`request_x_splits`)
        self.down_split: SplitRequest | None = None

    def fuse_projections(self) -> list[str]:
        """Stack gate_proj and up_proj where their weights allow (`fuse_into`); returns the
        fused modules' names."""
        return ["gate_up_proj"] if fuse_into(self, "gate_up_proj", ("gate_proj", "up_proj")) else []

    def forward(
        self, x: torch.Tensor | NormedRows, after: NormAfter | None = None
    ) -> torch.Tensor | tuple[NormedRows, torch.Tensor]:
        """down(silu(gate(x)) * up(x)); x may be a folded norm's rows, and with `after` the
        next norm is folded into down (`linear.linear_then_norm`)."""
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
            return linear_then_norm(self.down_proj, silu_mul(gate, up, self.down_split), after)
        stacked = self.gate_up_proj.linear
        if isinstance(stacked, GroupwiseLinear) and takes_swiglu_linear(x, stacked.encoded):
            # one launch for both products and the SwiGLU; its rows (2 to 8) are more than
            # down_split is ever wanted for (`x_split.INT_MAX_ROWS`)
            return linear_then_norm(self.down_proj, swiglu_linear(x, stacked.encoded), after)
        gate, up = self.gate_up_proj(x)
        return linear_then_norm(self.down_proj, silu_mul(gate, up, self.down_split), after)
