"""The arithmetic behind the tensor-core GEMV's packed dequantization
(`groupwise_gemv_triton._BF16_HALVES_PTX`), checked on the CPU: the PTX text itself, run by a
small emulator of its five instructions, decodes every q4 byte at every position of its word
as `EncodedTensor.decode` does; and for every finite fp16 scale and every code, the scale
splits into bf16 parts hi + lo exactly, code * lo is exact in bf16, and code * hi + code * lo
is code * scale exactly, so one rounding of that sum to bf16 (the PTX's fused multiply-add)
gives what rounding the fp32 product does."""

from __future__ import annotations

import re

import torch

from ninfer.kernels.groupwise_gemv_triton import _BF16_CODES_PTX, _BF16_HALVES_PTX
from ninfer.quant import EncodedTensor

MASK = (1 << 32) - 1


def _halves(reg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two bf16 halves of 32-bit registers (int64 tensors), as float64."""

    def half(bits):
        return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16).double()

    return half(reg & 0xFFFF), half(reg >> 16)


def _bf16_bits(value: torch.Tensor) -> torch.Tensor:
    """float64 values that fit in fp32 exactly, rounded once to bf16 (nearest, ties to even)."""
    single = value.float()
    assert torch.equal(single.double(), value), "the emulated fma lost bits before rounding"
    return single.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def _prmt(a: torch.Tensor, b: torch.Tensor, selector: int) -> torch.Tensor:
    source = a | (b << 32)
    out = torch.zeros_like(a)
    for i in range(4):
        pick = (selector >> (4 * i)) & 0xF
        assert pick < 8, "sign-replicating selectors are not emulated"
        out |= ((source >> (8 * pick)) & 0xFF) << (8 * i)
    return out


def _lop3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, lut: int) -> torch.Tensor:
    out = torch.zeros_like(a)
    for index in range(8):
        if lut >> index & 1:
            term = torch.full_like(a, MASK)
            for bit, operand in ((4, a), (2, b), (1, c)):
                term &= operand if index & bit else ~operand & MASK
            out |= term
    return out


def _fma_bf16x2(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    # the products of bf16 values and their sums here are exact in float64
    (a0, a1), (b0, b1), (c0, c1) = _halves(a), _halves(b), _halves(c)
    return _bf16_bits(a0 * b0 + c0) | (_bf16_bits(a1 * b1 + c1) << 16)


def _run_ptx(text: str, operands: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runs the instructions of `text` over int64 tensors of 32-bit register values; `$n`
    operands are looked up in (and outputs written to) `operands`."""
    regs = dict(operands)

    def value(token: str) -> torch.Tensor:
        token = token.strip()
        if token in regs:
            return regs[token]
        return torch.full_like(next(iter(operands.values())), int(token, 0))

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dest, *sources = [arg.strip() for arg in args.split(",")]
        if op == "mov.b32":
            result = value(sources[0])
        elif op == "shr.b32":
            result = value(sources[0]) >> int(sources[1], 0)
        elif op == "prmt.b32":
            result = _prmt(value(sources[0]), value(sources[1]), int(sources[2], 0))
        elif op == "lop3.b32":
            a, b, c = (value(s) for s in sources[:3])
            result = _lop3(a, b, c, int(sources[3], 0))
        elif op == "fma.rn.bf16x2":
            result = _fma_bf16x2(*(value(s) for s in sources))
        else:
            raise AssertionError(f"instruction not emulated: {op}")
        regs[dest] = result & MASK
    return regs


def _pair_bits(bits: torch.Tensor) -> torch.Tensor:
    bits = bits.to(torch.int64) & 0xFFFF
    return bits | (bits << 16)


def test_the_ptx_decodes_every_byte_at_every_position_as_the_reference():
    ptx = _BF16_HALVES_PTX.value
    assert set(re.findall(r"\$\d+", ptx)) == {f"${i}" for i in range(9)}
    torch.manual_seed(0)
    scales = torch.cat(
        [
            torch.tensor([0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 6e-8, 6.1e-5, 0.3333]),
            torch.randn(55) * torch.logspace(-7, 4, 55),
        ]
    ).half()
    # word w holds bytes (w + j * 64) % 256 at positions j = 0..3: each byte at each position
    words = torch.arange(256, dtype=torch.int64)
    bytes_ = torch.stack([(words + 64 * j) % 256 for j in range(4)], dim=1)  # [256, 4]
    raw = (bytes_ << torch.tensor([0, 8, 16, 24])).sum(dim=1)
    hi = scales.float().to(torch.bfloat16)
    lo = (scales.float() - hi.float()).to(torch.bfloat16)
    shape = (scales.shape[0], words.shape[0])
    operands = {"$4": raw.expand(shape).clone()}
    for j in range(2):  # the parts of bytes 0-1, then of bytes 2-3 (one scale per row here)
        operands[f"${5 + j}"] = _pair_bits(hi.view(torch.int16))[:, None].expand(shape).clone()
        operands[f"${7 + j}"] = _pair_bits(lo.view(torch.int16))[:, None].expand(shape).clone()
    regs = _run_ptx(ptx, operands)

    def values(first: str, second: str) -> torch.Tensor:  # [S, 256, 4]: bytes 0-3 of a word
        pairs = torch.stack([regs[first], regs[second]], dim=-1)
        return torch.stack([pairs & 0xFFFF, pairs >> 16], dim=-1).reshape(*shape, 4)

    # value 2j is byte j's low nibble's, 2j + 1 its high nibble's
    got = torch.stack([values("$0", "$1"), values("$2", "$3")], dim=-1)
    got = got.to(torch.int32).to(torch.int16).view(torch.bfloat16).reshape(scales.shape[0], -1)

    # the reference: every scale's row holds the 1024 bytes, 16 groups of 32 bytes
    codes = bytes_.reshape(1, -1).expand(scales.shape[0], -1).to(torch.uint8).contiguous()
    encoded = EncodedTensor(
        "q4_g64_fp16",
        "row_groups_v1",
        (scales.shape[0], 2048),
        {"codes": codes, "scales": scales[:, None].expand(-1, 32).contiguous()},
    )
    want = encoded.decode(torch.bfloat16)
    # bit for bit, except that a zero's sign may differ (`_bf16_halves`); + 0.0 makes -0 +0
    assert torch.equal((got + 0.0).view(torch.int16), (want + 0.0).view(torch.int16))
    assert torch.equal(got, want)


def test_two_bf16_parts_give_code_times_scale_rounded_once():
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    scales = bits.view(torch.float16).double()
    scales = scales[torch.isfinite(scales)]
    hi = scales.float().to(torch.bfloat16).double()
    lo_bf16 = (scales - hi).float().to(torch.bfloat16)
    lo = lo_bf16.double()
    assert torch.equal(hi + lo, scales)  # the split is exact
    for code in range(-8, 8):
        low_part = code * lo
        assert torch.equal(low_part.float().to(torch.bfloat16).double(), low_part)
        exact = code * hi + low_part
        assert torch.equal(exact, code * scales)
        reference = (torch.tensor(float(code)) * scales.float()).to(torch.bfloat16)
        assert torch.equal(exact.float().to(torch.bfloat16), reference)


def test_the_codes_ptx_gives_every_byte_its_exact_codes():
    """`_BF16_CODES_PTX` (the q4 form that scales after the product): every byte at every
    position of its word becomes the bf16 codes of its low nibble (value 2j, in the first two
    registers) and of its high nibble (value 2j + 1, in the last two)."""
    ptx = _BF16_CODES_PTX.value
    assert set(re.findall(r"\$\d+", ptx)) == {f"${i}" for i in range(5)}
    words = torch.arange(256, dtype=torch.int64)
    bytes_ = torch.stack([(words + 64 * j) % 256 for j in range(4)], dim=1)  # [256, 4]
    raw = (bytes_ << torch.tensor([0, 8, 16, 24])).sum(dim=1)
    regs = _run_ptx(ptx, {"$4": raw})
    for first, second, nibble in (("$0", "$1", bytes_ & 15), ("$2", "$3", bytes_ >> 4)):
        halves = [*_halves(regs[first]), *_halves(regs[second])]  # bytes 0, 1, 2, 3
        code = (nibble ^ 8) - 8  # two's complement
        assert torch.equal(torch.stack(halves, dim=1), code.double())
