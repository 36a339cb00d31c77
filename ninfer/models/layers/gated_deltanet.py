"""Gated DeltaNet mixer: projections, causal conv (window carried in a state slot) + SiLU,
gated delta rule with a state per slot (fp32, or bf16 updated in fp32: `gdn_state_dtype`;
chunked for prefill, recurrent for decode),
gated RMSNorm with silu(z), out_proj. After loading, `fuse_projections` runs in_proj_qkv with
in_proj_z and in_proj_b with in_proj_a as one linear each (the names load the weights); on
the GPU a one-token decode step then computes the b|a product and the gates inside the
recurrent kernel (one launch for product, gates and rule, and for the output norm too where a
head is in at most four column blocks), and a small prefill or a decode step of several
sequences inside the conv's kernel (one launch for conv, product and gates)."""

import torch
from torch import nn

from ninfer.kernels.dispatch import (
    causal_conv1d,
    causal_conv1d_and_gates,
    chunk_gated_delta_rule,
    gdn_gates,
    gdn_gates_from_x,
    groupwise_linear_conv,
    groupwise_linear_conv_and_gates,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_from_x,
    recurrent_gated_delta_rule_from_x_normed,
    recurrent_gated_delta_rule_normed,
)
from ninfer.kernels.norm_fold import NormAfter, NormedRows
from ninfer.kernels.x_split import INT_MAX_ROWS
from ninfer.models.context import ForwardContext
from ninfer.models.layers.linear import FusedLinear, GroupwiseLinear, fuse_into, linear_then_norm
from ninfer.models.layers.norms import GatedRMSNorm

# Up to this many tokens (decode batches, speculative verification) a kernel computes the dense
# b|a product itself (the recurrent kernel at decode, else the gates kernel), saving the
# product's launches; each token then re-reads the 2H x hidden weight, so prefill-sized
# batches keep the matmul (which reads it once) and the gates kernel.
GATES_FROM_X_MAX_TOKENS = 16
# ... and at a decode step of up to this many tokens that kernel is the recurrent one; above
# it (and for a small prefill) the conv's kernel computes them in programs of their own
# (`causal_conv1d_and_gates`) and the recurrent kernel takes g and beta. Inside
# the recurrent kernel every program (sequence, head, column block) reads its head's two b|a
# rows and x's row again: at eight sequences (27B) the kernel took 22.2 us against 17.5 us
# with the gates given, and the 27B C=8 step was 0.09 ms faster with the gates kernel apart
# (C=4 0.02 ms; docs/performance.md, Measurement 14).
GATES_IN_RULE_MAX_TOKENS = 1
# At a decode step of two to eight sequences on Hopper the in projection's kernel runs the conv
# in its epilogue and the gates in programs of its own grid (`groupwise_linear_conv_and_gates`),
# where the conv's kernel ran them after it; False keeps that kernel (for timing the two).
CONV_GATES_IN_PROJECTION = True
# Where the recurrent kernel computes the gates (one token), it also runs the output norm, in
# each head's last column block (`recurrent_gated_delta_rule_from_x_normed`): one
# launch fewer a layer. False runs the norm's own kernel after it (for timing the two).
NORM_IN_RULE = True


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel: int,
        eps: float,
        cache_index: int,
    ) -> None:
        super().__init__()
        self.num_key_heads = num_key_heads
        self.num_value_heads = num_value_heads
        self.key_head_dim = key_head_dim
        self.value_head_dim = value_head_dim
        self.key_dim = num_key_heads * key_head_dim
        self.value_dim = num_value_heads * value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.cache_index = cache_index  # which GDN layer of ModelCache holds our state
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.empty(num_value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_value_heads), requires_grad=False)
        self.norm = GatedRMSNorm(value_head_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.in_proj_qkvz: FusedLinear | None = None
        self.in_proj_ba: FusedLinear | None = None

    def fuse_projections(self) -> list[str]:
        """Stack in_proj_qkv with in_proj_z and in_proj_b with in_proj_a where their weights
        allow (`fuse_into`); returns the fused modules' names."""
        pairs = {
            "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
            "in_proj_ba": ("in_proj_b", "in_proj_a"),
        }
        return [name for name, parts in pairs.items() if fuse_into(self, name, parts)]

    def ba_weight_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The stacked b|a weight where a kernel is to compute the b|a product of x itself: off
        the CPU, stacked dense, decode-sized batches. None elsewhere: the CPU, the reference
        path, keeps its per-part products (`FusedLinear` says why)."""
        fused = self.in_proj_ba
        if (
            fused is not None
            and type(fused.linear) is nn.Linear
            and x.device.type != "cpu"
            and x.shape[0] <= GATES_FROM_X_MAX_TOKENS
        ):
            return fused.linear.weight
        return None

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g fp32, beta) of each token and value head from the b and a products, where no
        kernel computes them from x (`ba_weight_for` gives no weight)."""
        if self.in_proj_ba is None:
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        else:
            b, a = self.in_proj_ba(x)
        return gdn_gates(b, a, self.A_log, self.dt_bias)

    def project_and_conv(
        self, x: torch.Tensor, ctx: ForwardContext, ba_weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(silu(conv(q|k|v)), z, gates): gates the (g, beta) of `gdn_gates_from_x` with
        ba_weight where it is given, computed in the conv's kernel, else None. A decode step
        with the projections stacked and encoded, off the CPU, runs the conv inside the
        product's kernel (one launch fewer): at one token the integer GEMV's, at two to eight
        the Gluon product's, which computes the gates too (`groupwise_linear_conv_and_gates`:
        one launch between the norm and the recurrent kernel)."""
        taps, windows = self.conv1d.weight[:, 0], ctx.cache.conv_window[self.cache_index]
        fused = self.in_proj_qkvz
        if (
            fused is not None
            and ctx.is_decode
            and isinstance(fused.linear, GroupwiseLinear)
            and x.device.type != "cpu"
            and x.shape[0] <= INT_MAX_ROWS
        ):
            mixed, z = groupwise_linear_conv(
                x, fused.linear.encoded, taps, windows, ctx.state_slots, ctx.query_start
            )
            gates = None
            if ba_weight is not None:
                gates = gdn_gates_from_x(x, ba_weight, self.A_log, self.dt_bias)
            return mixed, z, gates
        if (
            CONV_GATES_IN_PROJECTION
            and fused is not None
            and ba_weight is not None
            and ctx.is_decode
            and isinstance(fused.linear, GroupwiseLinear)
            and fused.linear.one_row is None
        ):
            done = groupwise_linear_conv_and_gates(
                x,
                fused.linear.encoded,
                taps,
                windows,
                ctx.state_slots,
                ba_weight,
                self.A_log,
                self.dt_bias,
            )
            if done is not None:
                mixed, z, g, beta = done
                return mixed, z, (g, beta)
        if fused is None:
            mixed_qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
        else:
            mixed_qkv, z = fused(x)
        if ba_weight is None:
            conv = causal_conv1d(mixed_qkv, taps, windows, ctx.state_slots, ctx.query_start)
            return conv, z, None
        conv, g, beta = causal_conv1d_and_gates(
            mixed_qkv,
            taps,
            windows,
            ctx.state_slots,
            ctx.query_start,
            x,
            ba_weight,
            self.A_log,
            self.dt_bias,
        )
        return conv, z, (g, beta)

    def forward(
        self, x: torch.Tensor | NormedRows, ctx: ForwardContext, after: NormAfter | None = None
    ) -> torch.Tensor | tuple[NormedRows, torch.Tensor]:
        """x may be a folded norm's rows (the in projection and the gates' kernel take them);
        with `after` the norm after the layer is folded into out_proj
        (`linear.linear_then_norm`), and at a decode step the output norm before it too."""
        tokens = x.shape[0]
        # Where a kernel computes the gates from x (`ba_weight_for`): at a one-token decode
        # step the recurrent kernel (one launch fewer), else the conv's kernel.
        ba_weight = self.ba_weight_for(x)
        in_rule = ba_weight is not None and ctx.is_decode and tokens <= GATES_IN_RULE_MAX_TOKENS
        if ba_weight is None:
            g, beta = self.gates(x)
        mixed, z, gates = self.project_and_conv(x, ctx, None if in_rule else ba_weight)
        if gates is not None:
            g, beta = gates
        query, key, value = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.view(tokens, self.num_key_heads, self.key_head_dim)
        key = key.view(tokens, self.num_key_heads, self.key_head_dim)
        value = value.view(tokens, self.num_value_heads, self.value_head_dim)

        states = ctx.cache.gdn_state[self.cache_index]
        rule_from_x = (query, key, value, x, ba_weight, self.A_log, self.dt_bias, states)
        rule_from_x += (ctx.state_slots, ctx.query_start)
        if in_rule and NORM_IN_RULE:
            z = z.view(tokens, self.num_value_heads, self.value_head_dim)
            norm = (z, self.norm.weight, self.norm.eps, self.norm.split_request)
            # `normed` holds the norm's output (and its x split) alive, as below
            normed = recurrent_gated_delta_rule_from_x_normed(*rule_from_x, *norm)
            return linear_then_norm(self.out_proj, normed.reshape(tokens, self.value_dim), after)
        if in_rule:
            out = recurrent_gated_delta_rule_from_x(*rule_from_x)
        elif after is not None and ctx.is_decode:
            # folding the norms: the output norm in the recurrent kernel and out_proj too
            # (`norm_fold.HeadNormedRows`), one launch fewer
            z = z.view(tokens, self.num_value_heads, self.value_head_dim)
            normed_out = recurrent_gated_delta_rule_normed(
                query,
                key,
                value,
                g,
                beta,
                states,
                ctx.state_slots,
                ctx.query_start,
                z,
                self.norm.weight,
                self.norm.eps,
            )
            return linear_then_norm(self.out_proj, normed_out, after)
        else:
            rule = recurrent_gated_delta_rule if ctx.is_decode else chunk_gated_delta_rule
            out = rule(query, key, value, g, beta, states, ctx.state_slots, ctx.query_start)
        z = z.view(tokens, self.num_value_heads, self.value_head_dim)
        # `normed` holds the norm's output (and so its x split, kernels/x_split.py) alive
        # while out_proj reads the reshape: under inference mode a view keeps no base
        normed = self.norm(out, z)
        return linear_then_norm(self.out_proj, normed.reshape(tokens, self.value_dim), after)
