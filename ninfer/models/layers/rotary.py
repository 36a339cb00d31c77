"""Partial, interleaved multimodal RoPE (M-RoPE).

Only the first `rot = head_dim * partial_rotary_factor` dims rotate, in the half-split (NeoX)
form. Frequency i takes its angle from the H position if i % 3 == 1 and i < 3 * s_H, from W if
i % 3 == 2 and i < 3 * s_W, else from T. Text tokens carry one position on all three axes,
which reduces to 1-D RoPE. cos/sin are computed in fp32 and cast to the model dtype; the
attention layer rotates q and k with them in its prelude (`kernels/attention_prelude.py`).
"""

from collections.abc import Sequence

import torch


class RotaryEmbedding:
    def __init__(
        self,
        head_dim: int,
        partial_rotary_factor: float,
        theta: float,
        mrope_section: Sequence[int],
        device: torch.device | str,
    ) -> None:
        nominal = int(head_dim * partial_rotary_factor)
        # an odd nominal width still gets ceil(nominal / 2) frequencies, as in the reference
        exponents = torch.arange(0, nominal, 2, dtype=torch.float32, device=device)
        self.inv_freq = 1.0 / (theta ** (exponents / nominal))
        half = exponents.shape[0]
        self.rot_dim = 2 * half
        index = torch.arange(half, device=device)
        axis = torch.zeros(half, dtype=torch.long, device=device)
        axis[(index % 3 == 1) & (index < 3 * mrope_section[1])] = 1
        axis[(index % 3 == 2) & (index < 3 * mrope_section[2])] = 2
        self.axis_of_freq = axis

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] (text) or [3, T] (T/H/W). Returns cos, sin: [T, rot] in `dtype`."""
        if positions.dim() == 1:
            positions = positions[None].expand(3, -1)
        per_freq = positions.float()[self.axis_of_freq].t()  # [T, rot/2]
        angles = per_freq * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)
