"""Depthwise causal conv + SiLU over a flat varlen batch, continuing from a carried window of
the last K - 1 inputs per state slot (torch reference; the same call serves prefill and decode).
"""

import torch
import torch.nn.functional as F

from ninfer.kernels import gdn_gates


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_windows: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
) -> torch.Tensor:
    """x: [T, C]; weight: [C, K]; conv_windows: [num_slots, C, K - 1], read and updated in place.
    Returns silu(conv(x)) as [T, C] in x's dtype. The conv runs in the weight dtype."""
    channels, width = weight.shape
    out = torch.empty_like(x)
    starts = query_start.tolist()
    for i, slot in enumerate(state_slots.tolist()):
        begin, end = starts[i], starts[i + 1]
        window = conv_windows[slot]
        inputs = torch.cat([window, x[begin:end].t().to(window.dtype)], dim=1)  # [C, K-1+n]
        y = F.conv1d(inputs[None].to(weight.dtype), weight[:, None, :], groups=channels)[0]
        out[begin:end] = F.silu(y).t().to(x.dtype)
        window.copy_(inputs[:, inputs.shape[1] - (width - 1) :])
    return out


def causal_conv1d_and_gates(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_windows: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
    ba_x: torch.Tensor,
    w_ba: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`causal_conv1d` of x and `gdn_gates.gdn_gates_from_x` of ba_x: (conv output, g, beta)."""
    g, beta = gdn_gates.gdn_gates_from_x(ba_x, w_ba, A_log, dt_bias)
    return causal_conv1d(x, weight, conv_windows, state_slots, query_start), g, beta
