"""fp8_e4m3fn_row_bf16: one float8 e4m3fn code per value and one bf16 scale per row,
w = fp32(code) * fp32(scale). Layout `row_scale_v1`: `codes` [rows, K] then `scales` [rows].

Encoder: scale = bf16(amax(row) / 448) (the smallest positive normal bf16 if that rounds to 0;
0 for an all-zero row), code = e4m3fn(clamp(x / scale, -448, 448)) rounded to nearest even."""

from __future__ import annotations

import torch

from ninfer.quant.formats import PlaneSpec, WeightFormat, register_format, rows_and_k

E4M3_MAX = 448.0


class Fp8RowFormat(WeightFormat):
    name = "fp8_e4m3fn_row_bf16"
    layout = "row_scale_v1"
    quantized = True

    def plane_specs(self, shape: tuple[int, ...]) -> list[PlaneSpec]:
        rows, k = rows_and_k(tuple(shape))
        return [
            PlaneSpec("codes", torch.float8_e4m3fn, (rows, k)),
            PlaneSpec("scales", torch.bfloat16, (rows,)),
        ]

    def encode_rows(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        x = rows.to(torch.float32)
        if not torch.isfinite(x).all():
            raise ValueError(f"{self.name}: the tensor holds inf or nan")
        amax = x.abs().amax(dim=-1) if x.shape[-1] else torch.zeros(x.shape[0])
        scales = (amax / E4M3_MAX).to(torch.bfloat16)
        tiny = torch.tensor(torch.finfo(torch.bfloat16).tiny, dtype=torch.bfloat16)
        scales = torch.where((scales == 0) & (amax > 0), tiny, scales)
        scales32 = scales.to(torch.float32).unsqueeze(-1)
        safe = torch.where(scales32 == 0, torch.ones_like(scales32), scales32)
        codes = (x / safe).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return {"codes": codes, "scales": scales}

    def decode(
        self, planes: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype | None
    ) -> torch.Tensor:
        values = planes["codes"].to(torch.float32) * planes["scales"].to(torch.float32).unsqueeze(
            -1
        )
        values = values.reshape(shape)
        return values if dtype in (None, torch.float32) else values.to(dtype)


FP8_ROW = register_format(Fp8RowFormat())
