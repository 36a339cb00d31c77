"""Group-wise symmetric integer formats (q4_g64_fp16, q5_g64_fp16, q6_g64_fp16, q8_g32_fp16) and
their reference encoder MAXABS_F16_RECIP_RNE_V1.

Codes are signed along K in groups of G values with one fp16 multiplier per group and no zero
point: w = fp32(s) * code. K is padded with zeros to a multiple of G. Layout `row_groups_v1`:
- q4: `codes` [rows, Kp/2] u8, value 2j in the low nibble and 2j+1 in the high nibble (two's
  complement 4-bit);
- q5/q6: `codes` as q4 holding the low four bits, then `high` [rows, Kp/8] (q5, bit j of a byte
  is bit 4 of value 8i+j) or [rows, Kp/4] (q6, bits 2j..2j+1 of a byte are bits 4..5 of value
  4i+j);
- q8: `codes` [rows, Kp] i8 (-128 never occurs);
- `scales` [rows, Kp/G] fp16 last.
The separate high-bit planes keep the low nibbles identical to q4, so one unpack path serves all."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.quant.formats import (
    EncodedTensor,
    PlaneSpec,
    WeightFormat,
    align_up,
    get_format,
    register_format,
    rows_and_k,
)

ENCODER = "MAXABS_F16_RECIP_RNE_V1"
SMALLEST_F16_SCALE = 2.0**-24


class GroupwiseIntFormat(WeightFormat):
    layout = "row_groups_v1"
    quantized = True

    def __init__(self, name: str, bits: int, group: int):
        self.name = name
        self.bits = bits
        self.group = group
        if bits == 8:
            self.qmax, self.code_min, self.code_max = 127, -127, 127
        else:
            self.qmax = (1 << (bits - 1)) - 1
            self.code_min, self.code_max = -(1 << (bits - 1)), self.qmax

    def padded_k(self, k: int) -> int:
        return align_up(k, self.group)

    def plane_specs(self, shape: tuple[int, ...]) -> list[PlaneSpec]:
        rows, k = rows_and_k(tuple(shape))
        kp = self.padded_k(k)
        specs = []
        if self.bits == 8:
            specs.append(PlaneSpec("codes", torch.int8, (rows, kp)))
        else:
            specs.append(PlaneSpec("codes", torch.uint8, (rows, kp // 2)))
            if self.bits > 4:
                per_byte = 8 // (self.bits - 4)
                specs.append(PlaneSpec("high", torch.uint8, (rows, kp // per_byte)))
        specs.append(PlaneSpec("scales", torch.float16, (rows, kp // self.group)))
        return specs

    def quantize(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MAXABS_F16_RECIP_RNE_V1 on a [rows, K] slab: (int16 codes [rows, Kp], fp16 scales)."""
        x = rows.to(torch.float32)
        n, k = x.shape
        kp = self.padded_k(k)
        if kp != k:
            x = F.pad(x, (0, kp - k))
        if not torch.isfinite(x).all():
            raise ValueError(f"{self.name}: the tensor holds inf or nan")
        groups = x.reshape(n, kp // self.group, self.group)
        amax = groups.abs().amax(dim=-1)
        scales = (amax / self.qmax).to(torch.float16)
        if torch.isinf(scales).any():
            raise ValueError(
                f"{self.name}: a group's scale overflows fp16 (|w| up to {amax.max().item():g})"
            )
        tiny = torch.tensor(SMALLEST_F16_SCALE, dtype=torch.float16)
        scales = torch.where((scales == 0) & (amax > 0), tiny, scales)
        scales32 = scales.to(torch.float32)
        recip = torch.where(scales32 == 0, torch.zeros_like(scales32), 1.0 / scales32)
        codes = torch.round(groups * recip.unsqueeze(-1)).clamp_(self.code_min, self.code_max)
        return codes.to(torch.int16).reshape(n, kp), scales

    def encode_rows(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scales = self.quantize(rows)
        n, kp = codes.shape
        if self.bits == 8:
            return {"codes": codes.to(torch.int8), "scales": scales}
        low = (codes & 0xF).to(torch.uint8)
        planes = {"codes": low[:, 0::2] | (low[:, 1::2] << 4)}
        if self.bits > 4:
            width = self.bits - 4
            per_byte = 8 // width
            high = (
                ((codes >> 4) & ((1 << width) - 1))
                .to(torch.uint8)
                .reshape(n, kp // per_byte, per_byte)
            )
            packed = torch.zeros(n, kp // per_byte, dtype=torch.uint8, device=codes.device)
            for j in range(per_byte):
                packed |= high[:, :, j] << (j * width)
            planes["high"] = packed
        planes["scales"] = scales
        return planes

    def unpack_codes(self, planes: dict[str, torch.Tensor]) -> torch.Tensor:
        """Signed codes [rows, Kp] as int16."""
        if self.bits == 8:
            return planes["codes"].to(torch.int16)
        packed = planes["codes"]
        n = packed.shape[0]
        low = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, -1).to(torch.int16)
        if self.bits > 4:
            width = self.bits - 4
            per_byte = 8 // width
            high = planes["high"]
            parts = [(high >> (j * width)) & ((1 << width) - 1) for j in range(per_byte)]
            low = low | (torch.stack(parts, dim=-1).reshape(n, -1).to(torch.int16) << 4)
        sign = 1 << (self.bits - 1)
        return torch.where(low >= sign, low - 2 * sign, low)

    def decode(
        self, planes: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype | None
    ) -> torch.Tensor:
        codes = self.unpack_codes(planes).to(torch.float32)
        n, kp = codes.shape
        scales = planes["scales"].to(torch.float32)
        values = (codes.reshape(n, kp // self.group, self.group) * scales.unsqueeze(-1)).reshape(
            n, kp
        )
        _, k = rows_and_k(tuple(shape))
        values = values[:, :k].reshape(shape)
        return values if dtype in (None, torch.float32) else values.to(dtype)


def widen_to_q8(encoded: EncodedTensor, rows_per_block: int = 8192) -> EncodedTensor:
    """A q5_g64 or q6_g64 tensor as q8_g32 holding the same values: its codes fit in int8 and
    each 64-group's scale serves both 32-groups of it (exact: `decode` gives the same bits).
    The planes stay on their device; codes are unpacked `rows_per_block` rows at a time, so the
    transient int16 codes stay small beside a large head."""
    source = get_format(encoded.format)
    if not (isinstance(source, GroupwiseIntFormat) and 4 < source.bits < 8 and source.group == 64):
        raise ValueError(f"{encoded.format} does not widen to q8_g32_fp16")
    # q8_g32 pads K to 32, maybe less than the 64-group format did: the columns past it are
    # padding zeros, dropped so that the planes are q8_g32's own (and stack with native ones)
    kp = align_up(rows_and_k(tuple(encoded.shape))[1], 32)
    scales = encoded.planes["scales"]
    rows = scales.shape[0]
    codes = torch.empty(rows, kp, dtype=torch.int8, device=scales.device)
    for start in range(0, rows, rows_per_block):
        block = {
            name: plane[start : start + rows_per_block] for name, plane in encoded.planes.items()
        }
        codes[start : start + rows_per_block] = source.unpack_codes(block)[:, :kp].to(torch.int8)
    scales = scales.repeat_interleave(2, dim=-1)[:, : kp // 32].contiguous()
    planes = {"codes": codes, "scales": scales}
    return EncodedTensor("q8_g32_fp16", encoded.layout, encoded.shape, planes)


Q4_G64 = register_format(GroupwiseIntFormat("q4_g64_fp16", 4, 64))
Q5_G64 = register_format(GroupwiseIntFormat("q5_g64_fp16", 5, 64))
Q6_G64 = register_format(GroupwiseIntFormat("q6_g64_fp16", 6, 64))
Q8_G32 = register_format(GroupwiseIntFormat("q8_g32_fp16", 8, 32))
