"""Random inputs for the kernel tests, shared by the interpreter tests (tests/kernels) and the
GPU tests (tests/gpu): each case builds fresh inputs, and `check_*` runs a kernel implementation
and the torch reference on copies of them and compares outputs and in-place state."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ninfer.engine.kv_pool import PAGE_SIZE
from ninfer.kernels import attention_prelude as prelude_reference
from ninfer.kernels import causal_conv1d as conv_reference
from ninfer.kernels import gated_rms_norm as gated_norm_reference
from ninfer.kernels import gdn_chunked as chunked_reference
from ninfer.kernels import gdn_gates as gates_reference
from ninfer.kernels import gdn_recurrent as gdn_reference
from ninfer.kernels import groupwise_dequant as dequant_reference
from ninfer.kernels import groupwise_gemv as gemv_reference
from ninfer.kernels import kv_write as kv_write_reference
from ninfer.kernels import paged_attention as attention_reference
from ninfer.kernels import rms_norm as norm_reference
from ninfer.kernels import rotary as rotary_reference
from ninfer.kernels import swiglu as swiglu_reference
from ninfer.quant import EncodedTensor, get_format


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values in the kernel output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def query_start_of(query_lens: list[int], device) -> torch.Tensor:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)


def check_paged_attention(
    module,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device,
    tol: float,
) -> None:
    """Sequences on scattered pages of a pool larger than they need; max_seq_len both given and
    read from the device."""
    pages_each = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in seq_lens]
    num_pages = sum(pages_each) + 3
    k_cache = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim, device=device).to(dtype)
    order = torch.randperm(num_pages).tolist()
    page_table = torch.full((len(seq_lens), max(pages_each) + 1), -1, dtype=torch.int32)
    for i, count in enumerate(pages_each):
        page_table[i, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    page_table = page_table.to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens), num_heads, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    ref = attention_reference.paged_attention_decode(q, k_cache, v_cache, page_table, lens, scale)
    for max_seq_len in (max(seq_lens), None):
        out = module.paged_attention_decode(
            q, k_cache, v_cache, page_table, lens, scale, max_seq_len
        )
        assert out.dtype == q.dtype and out.shape == q.shape
        assert relative_error(out, ref) < tol


def gdn_inputs(
    query_lens: list[int],
    num_key_heads: int,
    num_value_heads: int,
    key_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    device,
    max_decay: float,
):
    """Random q, k, v, g (log decay in [-max_decay, 0], fp32), beta and a pool of nonzero fp32
    states with two slots more than sequences; the sequences' slots shuffled in it."""
    tokens = sum(query_lens)
    num_slots = len(query_lens) + 2
    q = torch.randn(tokens, num_key_heads, key_dim, device=device).to(dtype)
    k = torch.randn(tokens, num_key_heads, key_dim, device=device).to(dtype)
    v = torch.randn(tokens, num_value_heads, value_dim, device=device).to(dtype)
    g = -torch.rand(tokens, num_value_heads, device=device) * max_decay
    beta = torch.rand(tokens, num_value_heads, device=device).to(dtype)
    states = torch.randn(num_slots, num_value_heads, key_dim, value_dim, device=device) * 0.5
    slots = torch.randperm(num_slots)[: len(query_lens)].to(torch.int32).to(device)
    return q, k, v, g, beta, states, slots, query_start_of(query_lens, device)


def check_gdn_recurrent(
    module,
    query_lens: list[int],
    num_key_heads: int,
    num_value_heads: int,
    key_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    device,
    tol: float,
    state_dtype: torch.dtype = torch.float32,
) -> None:
    """Sequences in shuffled slots of a larger pool; untouched slots must stay as they were.
    With bf16 states both update in fp32 and round the state once when they store it."""
    q, k, v, g, beta, states, slots, query_start = gdn_inputs(
        query_lens, num_key_heads, num_value_heads, key_dim, value_dim, dtype, device, 2.0
    )
    states = states.to(state_dtype)
    ref_states = states.clone()
    ref = gdn_reference.recurrent_gated_delta_rule(q, k, v, g, beta, ref_states, slots, query_start)
    out = module.recurrent_gated_delta_rule(q, k, v, g, beta, states, slots, query_start)
    assert out.dtype == v.dtype and out.shape == v.shape
    assert relative_error(out, ref) < tol
    assert states.dtype == state_dtype
    assert relative_error(states, ref_states) < (1e-4 if state_dtype == torch.float32 else 1e-2)


def check_gdn_recurrent_normed(
    module,
    query_lens: list[int],
    num_key_heads: int,
    num_value_heads: int,
    key_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    device,
) -> None:
    """The delta rule with the GDN output norm folded in (`recurrent_gated_delta_rule_normed`)
    against the kernel without it, then the fold's reference (`norm_fold.fold_gated_norm`):
    the same states bit for bit, the same weighted rows within one rounding (the reference
    multiplies in another order), the sums of squares over the kernel's column blocks within
    fp32 summation order; and materialized, the gated norm's output within the roundings of
    both."""
    from ninfer.kernels import gated_rms_norm as gated_norm_reference
    from ninfer.kernels import norm_fold

    q, k, v, g, beta, states, slots, query_start = gdn_inputs(
        query_lens, num_key_heads, num_value_heads, key_dim, value_dim, dtype, device, 2.0
    )
    z = torch.randn(v.shape[0], num_value_heads, value_dim + 4, device=device).to(dtype)
    z = z[..., :value_dim]  # a view of the in projection's output, as the model passes it
    weight = (torch.randn(value_dim, device=device) * 0.5 + 1).to(dtype)
    plain_states = states.clone()
    out = module.recurrent_gated_delta_rule(q, k, v, g, beta, plain_states, slots, query_start)
    rows = module.recurrent_gated_delta_rule_normed(
        q, k, v, g, beta, states, slots, query_start, z, weight, 1e-6
    )
    assert torch.equal(states, plain_states)
    blocks = rows.squares.shape[-1]
    assert getattr(module, "num_sms", None) is None or blocks > 1  # the kernel's blocks tested
    want = norm_fold.fold_gated_norm(out, z, weight, 1e-6, value_dim // blocks)
    assert rows.weighted.shape == want.weighted.shape and rows.head_dim == value_dim
    ulp = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    bound = ulp * want.weighted.float().abs() + 1e-30
    assert ((rows.weighted.float() - want.weighted.float()).abs() <= bound).all()
    torch.testing.assert_close(rows.squares, want.squares, rtol=1e-5, atol=1e-30)
    normed = gated_norm_reference.gated_rms_norm(out, z, weight, 1e-6)
    got = rows.materialize().view(normed.shape)
    # two roundings against the reference's three, each within half a unit
    assert relative_error(got, normed) < (
        2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    )


@contextmanager
def one_sequence_setting(recurrent_module):
    """Inside, the recurrent kernel module launches at several sequences as at one
    (`MAX_BLOCK_V`, `RECURRENT_WARPS`, no register cap) in place of its `SEQS_SETTING`, so
    that it reduces in the order of the kernel with the gates inside."""
    setting = recurrent_module.SEQS_SETTING
    one = (recurrent_module.MAX_BLOCK_V, recurrent_module.RECURRENT_WARPS, None)
    recurrent_module.SEQS_SETTING = one
    try:
        yield
    finally:
        recurrent_module.SEQS_SETTING = setting


def check_gdn_recurrent_from_x(
    recurrent_module,
    gates_module,
    query_lens: list[int],
    num_key_heads: int,
    num_value_heads: int,
    key_dim: int,
    value_dim: int,
    hidden: int,
    dtype: torch.dtype,
    device,
    tol: float,
) -> None:
    """The delta rule with the gates computed inside (`recurrent_gated_delta_rule_from_x`)
    against the two launches it replaces, `gates_module.gdn_gates_from_x` then
    `recurrent_module.recurrent_gated_delta_rule` at the one-sequence launch setting: outputs
    and states equal bit for bit (one dot-product helper, one gate arithmetic and one warp
    layout, so one summation order; a failure says how far apart they are). Against the
    torch reference (its own b|a product, whose rounding may differ by a step, then the gates
    and the rule) outputs and states within `tol`. x's rows strided; slots in descending order past two spare ones,
    which must stay exactly as they were."""
    q, k, v, _, _, states, _, query_start = gdn_inputs(
        query_lens, num_key_heads, num_value_heads, key_dim, value_dim, dtype, device, 2.0
    )
    slots = torch.arange(len(query_lens) + 1, 1, -1, dtype=torch.int32, device=device)
    x = torch.randn(q.shape[0], hidden + 8, device=device).to(dtype)[:, :hidden]
    ba_weight = (torch.randn(2 * num_value_heads, hidden, device=device) * 2 * hidden**-0.5).to(
        dtype
    )
    A_log = torch.randn(num_value_heads, device=device) * 0.5
    dt_bias = torch.randn(num_value_heads, device=device) * 2
    spare, two_launch_states, ref_states = states[:2].clone(), states.clone(), states.clone()
    out = recurrent_module.recurrent_gated_delta_rule_from_x(
        q, k, v, x, ba_weight, A_log, dt_bias, states, slots, query_start
    )
    assert out.dtype == v.dtype and out.shape == v.shape
    g, beta = gates_module.gdn_gates_from_x(x, ba_weight, A_log, dt_bias)
    with one_sequence_setting(recurrent_module):
        two_launch = recurrent_module.recurrent_gated_delta_rule(
            q, k, v, g, beta, two_launch_states, slots, query_start
        )
    assert torch.equal(out, two_launch), f"outputs {relative_error(out, two_launch):.1e} apart"
    assert torch.equal(states, two_launch_states), (
        f"states {relative_error(states, two_launch_states):.1e} apart"
    )
    ref = gdn_reference.recurrent_gated_delta_rule_from_x(
        q, k, v, x, ba_weight, A_log, dt_bias, ref_states, slots, query_start
    )
    assert relative_error(out, ref) < tol
    assert relative_error(states, ref_states) < tol
    assert torch.equal(states[:2], spare)


def check_gdn_recurrent_from_x_normed(
    recurrent_module,
    norm_module,
    num_key_heads: int,
    num_value_heads: int,
    key_dim: int,
    value_dim: int,
    hidden: int,
    split,
    dtype: torch.dtype,
    device,
) -> None:
    """The one-token delta rule with the gates inside and the GDN output norm run by each
    head's last column block (`recurrent_gated_delta_rule_from_x_normed`) against the two
    launches it replaces, `recurrent_gated_delta_rule_from_x` then
    `norm_module.gated_rms_norm` of its o: the norm's output, its attached integer-GEMV codes
    (`split`, a `SplitRequest` or None) and the states bit for bit, three times over (the
    arrival counters are left reset), z a strided view as the in projection gives it. Both
    launches store the state from one place in the kernel, so the states are also held to the
    torch reference, which a missing store fails. Two tokens are refused (None)."""
    from ninfer.kernels.x_split import attached

    q, k, v, _, _, states, _, query_start = gdn_inputs(
        [1], num_key_heads, num_value_heads, key_dim, value_dim, dtype, device, 2.0
    )
    slots = torch.tensor([2], dtype=torch.int32, device=device)
    x = torch.randn(1, hidden, device=device).to(dtype)
    ba_weight = (torch.randn(2 * num_value_heads, hidden, device=device) * 2 * hidden**-0.5).to(
        dtype
    )
    A_log = torch.randn(num_value_heads, device=device) * 0.5
    dt_bias = torch.randn(num_value_heads, device=device) * 2
    width = num_value_heads * value_dim
    z = torch.randn(1, 2 * width, device=device).to(dtype)[:, width:]
    z = z.view(1, num_value_heads, value_dim)
    norm_weight = (torch.randn(value_dim, device=device) * 0.5 + 1).to(dtype)
    args = (q, k, v, x, ba_weight, A_log, dt_bias)
    for _ in range(3):
        start = states.clone()
        normed = recurrent_module.recurrent_gated_delta_rule_from_x_normed(
            *args, states, slots, query_start, z, norm_weight, 1e-6, split
        )
        apart_states = start.clone()
        o = recurrent_module.recurrent_gated_delta_rule_from_x(
            *args, apart_states, slots, query_start
        )
        apart = norm_module.gated_rms_norm(o, z, norm_weight, 1e-6, split)
        assert normed.shape == apart.shape == v.shape and normed.dtype == v.dtype
        assert torch.equal(normed, apart), f"norms {relative_error(normed, apart):.1e} apart"
        assert torch.equal(states, apart_states)
        ref_states = start.clone()
        gdn_reference.recurrent_gated_delta_rule_from_x(*args, ref_states, slots, query_start)
        tol = {torch.float32: 1e-5, torch.float16: 1e-3}.get(dtype, 1e-2)
        assert relative_error(states, ref_states) < tol
        if split is not None:
            groups = width // split.group
            one = attached(normed.reshape(1, width), split.bits, split.group, groups)
            two = attached(apart.reshape(1, width), split.bits, split.group, groups)
            assert one is not None and two is not None
            assert torch.equal(one.codes, two.codes) and torch.equal(one.steps, two.steps)
            if split.bits == 4:  # q8's corrections are never written
                assert torch.equal(one.corr, two.corr)
    two_tokens = gdn_inputs(
        [2], num_key_heads, num_value_heads, key_dim, value_dim, dtype, device, 2.0
    )
    q2, k2, v2 = two_tokens[:3]
    x2 = torch.randn(2, hidden, device=device).to(dtype)
    z2 = torch.randn(v2.shape, device=device).to(dtype)
    refused = recurrent_module.recurrent_gated_delta_rule_from_x_normed(
        q2,
        k2,
        v2,
        x2,
        ba_weight,
        A_log,
        dt_bias,
        states,
        slots,
        two_tokens[7],
        z2,
        norm_weight,
        1e-6,
        split,
    )
    assert refused is None


def check_causal_conv1d(
    module,
    query_lens: list[int],
    channels: int,
    width: int,
    dtype: torch.dtype,
    device,
    tol: float,
) -> None:
    tokens = sum(query_lens)
    num_slots = len(query_lens) + 2
    x = torch.randn(tokens, channels, device=device).to(dtype)
    weight = (torch.randn(channels, width, device=device) / width**0.5).to(dtype)
    windows = torch.randn(num_slots, channels, width - 1, device=device).to(dtype)
    slots = torch.randperm(num_slots)[: len(query_lens)].to(torch.int32).to(device)
    query_start = query_start_of(query_lens, device)
    ref_windows = windows.clone()
    ref = conv_reference.causal_conv1d(x, weight, ref_windows, slots, query_start)
    out = module.causal_conv1d(x, weight, windows, slots, query_start)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert relative_error(out, ref) < tol
    assert torch.equal(windows, ref_windows)  # the new window is a copy of inputs, exactly


def check_causal_conv1d_and_gates(
    conv_module,
    gates_module,
    query_lens: list[int],
    channels: int,
    heads: int,
    hidden: int,
    dtype: torch.dtype,
    device,
    normed_rows: bool = False,
) -> None:
    """The conv and the gates from x in one launch (`causal_conv1d_and_gates`) give what the
    conv kernel and the gates kernel give apart, bit for bit, the windows included; the conv's
    input a view of a wider row, as the in projection's q|k|v part is. With `normed_rows` the
    gates read a folded norm's rows (`norm_fold.NormedRows`, random sums of squares)."""
    tokens = sum(query_lens)
    num_slots = len(query_lens) + 2
    mixed = torch.randn(tokens, channels + 8, device=device).to(dtype)[:, :channels]
    taps = (torch.randn(channels, 4, device=device) / 2).to(dtype)
    windows = torch.randn(num_slots, channels, 3, device=device).to(dtype)
    slots = torch.randperm(num_slots)[: len(query_lens)].to(torch.int32).to(device)
    query_start = query_start_of(query_lens, device)
    x = torch.randn(tokens, hidden + 8, device=device).to(dtype)[:, :hidden]
    if normed_rows:
        from ninfer.kernels.norm_fold import SQUARE_COLUMNS, NormedRows

        squares = torch.rand(5, SQUARE_COLUMNS, device=device) * hidden / 5
        x = NormedRows(x.contiguous(), squares, 1e-6)
    w_ba = (torch.randn(2 * heads, hidden, device=device) * 8 * hidden**-0.5).to(dtype)
    A_log = (torch.randn(heads, device=device) * 0.5).to(dtype)
    dt_bias = torch.linspace(-30, 30, heads, device=device).to(dtype)
    apart_windows = windows.clone()
    apart = (
        conv_module.causal_conv1d(mixed, taps, apart_windows, slots, query_start),
        *gates_module.gdn_gates_from_x(x, w_ba, A_log, dt_bias),
    )
    together = conv_module.causal_conv1d_and_gates(
        mixed, taps, windows, slots, query_start, x, w_ba, A_log, dt_bias
    )
    for got, want in zip(together, apart, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    assert torch.equal(windows, apart_windows)


def check_rms_norm(
    module, rows: int, dim: int, dtype: torch.dtype, device, tol: float, strided: bool
) -> None:
    """With and without the residual; `strided` normalises the first half of each wider row,
    as q_norm does on the query part of q_proj's output."""
    wide = torch.randn(rows, 2 * dim if strided else dim, device=device).to(dtype) * 3
    x = wide[:, :dim]
    residual = torch.randn(rows, dim, device=device).to(dtype)
    weight = (torch.randn(dim, device=device) * 0.1).to(dtype)
    eps = 1e-6
    assert (
        relative_error(module.rms_norm(x, weight, eps), norm_reference.rms_norm(x, weight, eps))
        < tol
    )
    y, total = module.rms_norm(x, weight, eps, residual)
    ref_y, ref_total = norm_reference.rms_norm(x, weight, eps, residual)
    assert torch.equal(total, ref_total)
    assert relative_error(y, ref_y) < tol


def check_gated_rms_norm(
    module, tokens: int, heads: int, dim: int, dtype: torch.dtype, device, tol: float
) -> None:
    """x a contiguous [tokens, heads, dim] as the delta rule returns it, z the heads of a slice of
    a wider projection (token rows strided), as a fused projection would give it. Passes when
    max |out - ref| <= tol * max |ref|: in half precision tol = finfo.eps, one rounding step at
    the output's scale, since the fp32 sum of squares and rsqrt differ from torch's in the last
    bits and can flip the rounding of normed (then of the output) by one step. In half precision
    under 1 % of the outputs may differ at all: the kernel rounds where the reference rounds
    (skipping the rounding of normed or of w * normed changes about a quarter of them)."""
    x = torch.randn(tokens, heads, dim, device=device).to(dtype) * 3
    wide = (torch.randn(tokens, heads * dim + 24, device=device) * 2).to(dtype)
    z = wide[:, 24:].view(tokens, heads, dim)
    weight = (1 + torch.randn(dim, device=device) * 0.2).to(dtype)
    eps = 1e-6
    out = module.gated_rms_norm(x, z, weight, eps)
    ref = gated_norm_reference.gated_rms_norm(x, z, weight, eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.isfinite(out).all()
    assert (out.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    if dtype != torch.float32:
        assert (out != ref).float().mean() < 0.01


def check_groupwise_linear(
    module, format_name: str, m: int, n: int, k: int, dtype: torch.dtype, device, tol: float
) -> None:
    """Against the fp32 product of the dequantized weight (the reference rounds the weight to
    the activation dtype first; the kernel does not, so fp32 is the fairer yardstick)."""
    encoded = get_format(format_name).encode(torch.randn(n, k) * 0.05)
    encoded.planes = {name: plane.to(device) for name, plane in encoded.planes.items()}
    x = torch.randn(m, k, device=device).to(dtype)
    exact = x.float() @ encoded.decode(torch.float32).T
    out = module.groupwise_linear(x, encoded)
    assert out.dtype == x.dtype and out.shape == (m, n)
    assert relative_error(out, exact) < tol
    assert relative_error(gemv_reference.groupwise_linear(x, encoded), exact) < tol


def check_integer_gemv_at_extreme_q4_codes(module, codes: str, device) -> None:
    """The one-row integer kernel (`module.integer_linear`, `module.split_x`) against the exact
    product of the codes with x's split, within the output's rounding (half an fp16 unit of
    each value) and the fp32 sums', where every q4 code is -8 or 7 (signed bytes of -128 and
    112 in the kernel) and x is near its groups' largest value, with fine codes of every size.
    `codes`: "low" (all -8: each group's int32 sum, 16 * 8 * 127 * 254 * 64 at most, is near
    its bound), "high" (all 7), or "mixed" (-8 and 7 at random and x of random signs, so that
    even and odd values and the four words of a load differ)."""
    fmt = get_format("q4_g64_fp16")
    n, k = 8, 512
    generator = torch.Generator().manual_seed(len(codes))
    encoded = fmt.encode(torch.randn(n, k, generator=generator))
    planes = encoded.planes
    if codes == "mixed":
        choice = torch.randint(0, 4, planes["codes"].shape, generator=generator)
        planes["codes"] = torch.tensor([0x88, 0x77, 0x87, 0x78], dtype=torch.uint8)[choice]
    else:
        planes["codes"].fill_(0x88 if codes == "low" else 0x77)
    encoded.planes = {name: plane.to(device) for name, plane in planes.items()}
    x = 3.0 * (1.0 - 0.05 * torch.rand(1, k, generator=generator))
    if codes == "mixed":
        x *= torch.randint(0, 2, (1, k), generator=generator) * 2.0 - 1.0
    else:
        x[0, 64:128] *= -1.0  # a group of the other sign
    x = x.to(device=device, dtype=torch.float16)
    out = module.integer_linear(x, encoded).double().cpu()
    split_codes, _, steps = module.split_x(x, 4, 64, k)
    raw = split_codes.cpu().reshape(2, -1, 1).view(torch.int8).reshape(2, -1).double()
    words = k // 8  # per word its even values' bytes, then (after all words) the odd ones'
    raw = torch.stack([raw[:, : 4 * words], raw[:, 4 * words :]], dim=-1).reshape(2, k)
    assert raw[1].abs().max() > 64  # fine codes of every size, not only the coarse ones
    split = (254 * raw[0] + raw[1]) * steps.cpu().double().repeat_interleave(64, 1)[0]
    weight = encoded.decode(torch.float32).double().cpu()
    exact = weight @ split
    magnitude = weight.abs() @ split.abs()  # bounds the fp32 sums' rounding
    assert ((out[0] - exact).abs() <= 2**-11 * exact.abs() + 1e-6 * magnitude).all()


def check_grouped_groupwise_linear(
    module,
    format_name: str,
    num_experts: int,
    n: int,
    k: int,
    tokens: int,
    pairs: int,
    dtype: torch.dtype,
    device,
    tol: float,
) -> None:
    """Random (token, expert) pairs, experts repeated and some never chosen: row p must be
    x[x_rows[p]] times expert experts[p]'s dequantized weight (in fp64: the kernel does not
    round the weight to the activation dtype first)."""
    fmt = get_format(format_name)
    stored = fmt.encode(torch.randn(num_experts, n, k, device=device) * k**-0.5)
    planes = {name: p.reshape(num_experts, n, -1) for name, p in stored.planes.items()}
    weight = EncodedTensor(fmt.name, fmt.layout, (num_experts, n, k), planes)
    x = torch.randn(tokens, k, device=device).to(dtype)
    x_rows = torch.randint(0, tokens, (pairs,), device=device)
    experts = torch.randint(0, num_experts, (pairs,), device=device)
    every_product = torch.einsum("enk,tk->etn", stored.decode(torch.float64), x.double())
    exact = every_product[experts, x_rows]
    out = module.grouped_groupwise_linear(x, weight, x_rows, experts)
    assert out.dtype == dtype and out.shape == (pairs, n)
    assert relative_error(out, exact) < tol
    reference = gemv_reference.grouped_groupwise_linear(x, weight, x_rows, experts)
    assert relative_error(reference, exact) < tol


def check_swiglu_combine(
    gemv_module,
    combine_module,
    format_name: str,
    held: int,
    hidden: int,
    width: int,
    top_k: int,
    dtype: torch.dtype,
    device,
) -> None:
    """One token's experts' down projection with the SwiGLU and the MoE combine in its kernel
    (`grouped_swiglu_combine`) against the two kernels it replaces, `grouped_swiglu_linear`
    then `combine_module.moe_combine`: the block's output bit for bit, three calls over the
    same mailbox, left at zero. `held` experts from global id 8 and the shared one stacked
    after them; one choice is another rank's expert (it adds zero); the shared gate's logit a
    strided column of the router's row, as the router gives it."""
    from ninfer.kernels.moe_routing import Routes
    from ninfer.quant import EncodedTensor, get_format

    first = 8
    stacked = get_format(format_name).encode(
        torch.randn((held + 1) * hidden, width, device=device) * width**-0.5
    )
    planes = {name: p.reshape(held + 1, hidden, -1) for name, p in stacked.planes.items()}
    weight = EncodedTensor(stacked.format, stacked.layout, (held + 1, hidden, width), planes)
    ids = torch.randperm(held, device=device)[: top_k - 1].sort().values + first
    ids = torch.cat([ids, torch.tensor([first + held + 3], device=device)])  # not held here
    local = torch.clamp(ids - first, 0, held - 1)
    routes = Routes(
        torch.softmax(torch.randn(1, top_k, device=device), dim=-1).to(dtype),
        ids[None].to(torch.int32),
        torch.zeros(top_k + 1, dtype=torch.int32, device=device),
        torch.cat([local, torch.tensor([held], device=device)]).to(torch.int32),
        torch.arange(top_k + 1, dtype=torch.int32, device=device),
    )
    logits = torch.randn(1, 33, device=device).to(dtype)
    shared_gate = logits[:, 32:]
    for _ in range(3):
        gate_up = (torch.randn(top_k + 1, 2 * width, device=device) * 2).to(dtype)
        out = gemv_module.grouped_swiglu_combine(gate_up, weight, routes, first, held, shared_gate)
        assert out is not None and out.shape == (1, hidden) and out.dtype == dtype
        outputs = gemv_module.grouped_swiglu_linear(
            gate_up, weight, routes.pairs, routes.pair_experts
        )
        two_kernels = combine_module.moe_combine(
            outputs[:top_k].view(1, top_k, hidden),
            routes.weights,
            routes.experts,
            first,
            held,
            outputs[top_k:],
            shared_gate,
        )
        assert torch.equal(out, two_kernels), f"{relative_error(out, two_kernels):.1e} apart"
    assert not gemv_module._combine_mailboxes[out.device].any()


def check_groupwise_dequant(
    module, format_name: str, n: int, k: int, dtype: torch.dtype, device
) -> None:
    """Planes of random bits, so every code occurs and the fp16 scales take both signs and
    every finite magnitude from the subnormals up (fp16 outputs overflow to inf, as in the
    reference): the dense weight must equal the reference bit for bit."""
    fmt = get_format(format_name)
    planes = {}
    for spec in fmt.plane_specs((n, k)):
        if spec.name == "scales":
            magnitude = torch.randint(0, 0x7C00, spec.shape, dtype=torch.int16)
            sign = torch.randint(0, 2, spec.shape).to(torch.float16) * 2 - 1
            planes[spec.name] = magnitude.view(torch.float16) * sign
        else:
            planes[spec.name] = torch.randint(0, 256, spec.shape, dtype=torch.uint8).view(
                spec.dtype
            )
    planes = {name: plane.to(device) for name, plane in planes.items()}
    encoded = EncodedTensor(fmt.name, fmt.layout, (n, k), planes)
    out = module.groupwise_dequant(encoded, dtype)
    assert out.dtype == dtype and out.shape == (n, k)
    assert torch.equal(out, dequant_reference.groupwise_dequant(encoded, dtype))


def scattered_pages(page_counts: list[int], spare: int = 3) -> tuple[int, torch.Tensor]:
    """(num_pages, page_table): each sequence gets `page_counts[i]` pages drawn in random order
    from a pool with `spare` pages nobody owns; -1 past each sequence's pages."""
    num_pages = sum(page_counts) + spare
    order = torch.randperm(num_pages).tolist()
    page_table = torch.full((len(page_counts), max(page_counts) + 1), -1, dtype=torch.int32)
    for i, count in enumerate(page_counts):
        page_table[i, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    return num_pages, page_table


def check_paged_prefill_attention(
    module,
    context_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device,
    tol: float,
) -> None:
    """A flat varlen batch of new chunks, each after its own cached prefix, the chunk's K/V
    already in the pages (the layer writes first). q is a strided view, as the query half of
    q_proj's output would be."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    num_pages, page_table = scattered_pages([(n + PAGE_SIZE - 1) // PAGE_SIZE for n in seq_lens])
    k_cache = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim, device=device).to(dtype)
    page_table = page_table.to(device)
    tokens = sum(query_lens)
    wide = torch.randn(tokens, num_heads, 2 * head_dim, device=device).to(dtype)
    q = wide[..., :head_dim]
    query_start = query_start_of(query_lens, device)
    contexts = torch.tensor(context_lens, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    args = (q, k_cache, v_cache, page_table, query_start, contexts, lens, scale)
    ref = attention_reference.paged_attention_prefill(*args)
    out = module.paged_attention_prefill(*args)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert relative_error(out, ref) < tol
    for i in range(len(query_lens)):  # no sequence may hide behind the others' error
        rows = slice(int(query_start[i]), int(query_start[i + 1]))
        assert relative_error(out[rows], ref[rows]) < tol, f"sequence {i}"


def check_kv_write(
    module, num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device
) -> None:
    """New rows land in random distinct slots of a random pool; the rest of the pool stays as
    it was. Copies are exact."""
    num_pages = num_tokens // PAGE_SIZE + 3
    k_cache = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim, device=device).to(dtype)
    slots = torch.randperm(num_pages * PAGE_SIZE)[:num_tokens].to(device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kv_write_reference.write_kv(k, v, ref_k, ref_v, slots)
    module.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def check_gdn_chunked(
    module,
    query_lens: list[int],
    num_key_heads: int,
    num_value_heads: int,
    key_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    device,
    tol: float,
    state_dtype: torch.dtype = torch.float32,
) -> None:
    """The prefill form against the chunked fp32 reference: sequences in shuffled slots of a
    larger pool with nonzero states (fp32, or bf16 read as fp32 and rounded when stored);
    untouched slots must stay exactly as they were."""
    q, k, v, g, beta, states, slots, query_start = gdn_inputs(
        query_lens, num_key_heads, num_value_heads, key_dim, value_dim, dtype, device, 0.5
    )
    states = states.to(state_dtype)
    ref_states = states.clone()
    ref = chunked_reference.chunk_gated_delta_rule(q, k, v, g, beta, ref_states, slots, query_start)
    out = module.chunk_gated_delta_rule(q, k, v, g, beta, states, slots, query_start)
    assert out.dtype == v.dtype and out.shape == v.shape
    assert relative_error(out, ref) < tol
    used = slots.long()
    assert relative_error(states[used], ref_states[used]) < tol
    untouched = torch.ones(states.shape[0], dtype=torch.bool)
    untouched[used.cpu()] = False
    assert torch.equal(states[untouched.to(device)], ref_states[untouched.to(device)])


def check_silu_mul(module, rows: int, width: int, dtype: torch.dtype, device, tol: float) -> None:
    """gate and up as the two halves of one wider product (strided rows), as a fused gate/up
    projection would give them."""
    fused = (torch.randn(rows, 2 * width, device=device) * 3).to(dtype)
    gate, up = fused[:, :width], fused[:, width:]
    out = module.silu_mul(gate, up)
    assert out.dtype == dtype and out.shape == gate.shape
    exact = swiglu_reference.silu_mul(gate.double(), up.double())
    assert relative_error(out, exact) < tol


def check_rotary(
    module,
    tokens: int,
    num_heads: int,
    head_dim: int,
    rot_dim: int,
    dtype: torch.dtype,
    device,
    tol,
) -> None:
    """Angles of real positions; dims past rot_dim must come back bit for bit."""
    positions = torch.randint(0, 100_000, (tokens,), device=device).double()
    inv_freq = 1e7 ** (-torch.arange(0, rot_dim, 2, device=device).double() / rot_dim)
    angles = positions[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = torch.randn(tokens, num_heads, head_dim, device=device).to(dtype)
    exact = rotary_reference.apply_rotary(x.double(), cos.double(), sin.double())
    out = module.apply_rotary(x.clone(), cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    assert relative_error(out[..., :rot_dim], exact[..., :rot_dim]) < tol
    assert torch.equal(out[..., rot_dim:], x[..., rot_dim:])


def prelude_inputs(
    tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rot_dim: int,
    dtype: torch.dtype,
    device,
    skipped: tuple[int, ...] = (),
) -> dict[str, torch.Tensor | float]:
    """An attention layer's prelude arguments as the layer passes them: query, key and value
    views of one fused q/k/v output (the query the first half of each head's [query | gate]),
    cos/sin of real positions, caches of random pages and distinct random slots, negative for
    the tokens in `skipped`."""
    query_width = num_heads * 2 * head_dim
    kv_width = num_kv_heads * head_dim
    qkv = (torch.randn(tokens, query_width + 2 * kv_width, device=device) * 3).to(dtype)
    query = qkv[:, :query_width].view(tokens, num_heads, 2 * head_dim)[..., :head_dim]
    key = qkv[:, query_width : query_width + kv_width].view(tokens, num_kv_heads, head_dim)
    value = qkv[:, query_width + kv_width :].view(tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 100_000, (tokens,), device=device).float()
    inv_freq = 1e7 ** (-torch.arange(0, rot_dim, 2, device=device).float() / rot_dim)
    angles = positions[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    num_pages = tokens // PAGE_SIZE + 3
    k_cache = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim, device=device).to(dtype)
    slots = torch.randperm(num_pages * PAGE_SIZE)[:tokens].to(device)
    slots[list(skipped)] = -1
    return {
        "query": query,
        "key": key,
        "value": value,
        "q_weight": (torch.randn(head_dim, device=device) * 0.1).to(dtype),
        "k_weight": (torch.randn(head_dim, device=device) * 0.1).to(dtype),
        "eps": 1e-6,
        "cos": angles.cos().to(dtype),
        "sin": angles.sin().to(dtype),
        "k_cache": k_cache,
        "v_cache": torch.randn_like(k_cache),
        "kv_write_slots": slots,
    }


def run_prelude(prelude, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, k_cache, v_cache) after `prelude` runs on fresh copies of the caches."""
    args = dict(inputs, k_cache=inputs["k_cache"].clone(), v_cache=inputs["v_cache"].clone())
    query = prelude(**args)
    return query, args["k_cache"], args["v_cache"]


def composed_prelude(norm, rotary, kv_write):
    """The prelude as the layer ran it unfused: `norm.rms_norm` of q and of k, `rotary`'s
    rotation of each (in place on the norms' fresh outputs), then `kv_write`."""

    def prelude(
        query, key, value, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, kv_write_slots
    ):
        query = rotary.apply_rotary(norm.rms_norm(query, q_weight, eps), cos, sin)
        key = rotary.apply_rotary(norm.rms_norm(key, k_weight, eps), cos, sin)
        kv_write.write_kv(key, value, k_cache, v_cache, kv_write_slots)
        return query

    return prelude


def check_attention_prelude(
    fused,
    norm,
    rotary,
    kv_write,
    tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rot_dim: int,
    dtype: torch.dtype,
    device,
    tol: float,
) -> None:
    """The fused prelude against the unfused kernels `norm`, `rotary` and `kv_write` run one
    after another: the query and both whole caches equal bit for bit, with all slots valid and
    (from T = 3) with token 1 skipped by a negative slot. Against the torch reference (valid
    slots only: its index_copy_ raises on -1): the query and the written K rows within `tol`
    (relative), the V rows exact, the rest of the pool as it was."""
    shape = (tokens, num_heads, num_kv_heads, head_dim, rot_dim, dtype, device)
    composed = composed_prelude(norm, rotary, kv_write)
    for skipped in ((), (1,)) if tokens >= 3 else ((),):
        inputs = prelude_inputs(*shape, skipped)
        query, k_cache, v_cache = run_prelude(fused.attention_prelude, inputs)
        ref_query, ref_k_cache, ref_v_cache = run_prelude(composed, inputs)
        assert query.shape == (tokens, num_heads, head_dim) and query.is_contiguous()
        assert torch.equal(query, ref_query)
        assert torch.equal(k_cache, ref_k_cache) and torch.equal(v_cache, ref_v_cache)
    inputs = prelude_inputs(*shape)
    query, k_cache, v_cache = run_prelude(fused.attention_prelude, inputs)
    ref_query, ref_k_cache, ref_v_cache = run_prelude(prelude_reference.attention_prelude, inputs)
    assert relative_error(query, ref_query) < tol
    rows = [cache.flatten(0, 1) for cache in (k_cache, v_cache, ref_k_cache, ref_v_cache)]
    written = inputs["kv_write_slots"]
    assert relative_error(rows[0][written], rows[2][written]) < tol
    assert torch.equal(rows[1][written], rows[3][written])
    kept = torch.ones(rows[0].shape[0], dtype=torch.bool, device=written.device)
    kept[written] = False
    assert torch.equal(rows[0][kept], rows[2][kept]) and torch.equal(rows[1][kept], rows[3][kept])


def check_gdn_gates(
    module, tokens: int, heads: int, dtype: torch.dtype, device, g_tol: float, beta_ulps: int
) -> None:
    """b and a as the halves of one fused [T, 2H] product; a + dt_bias spans softplus's
    pass-through above 20 and its tail far below 0. g (fp32) within `g_tol` of the reference
    elementwise (relative), beta within `beta_ulps` units of the last place of its dtype."""
    ba = (torch.randn(tokens, 2 * heads, device=device) * 8).to(dtype)
    b, a = ba[:, :heads], ba[:, heads:]
    A_log = (torch.randn(heads, device=device) * 0.5).to(dtype)
    dt_bias = torch.linspace(-30, 30, heads, device=device).to(dtype)
    g, beta = module.gdn_gates(b, a, A_log, dt_bias)
    ref_g, ref_beta = gates_reference.gdn_gates(b, a, A_log, dt_bias)
    assert g.dtype == torch.float32 and g.shape == (tokens, heads)
    assert beta.dtype == dtype and beta.shape == (tokens, heads)
    assert torch.allclose(g, ref_g, rtol=g_tol, atol=0.0)
    ulp = torch.finfo(dtype).eps / 2  # beta < 1: one unit in the last place is at most this
    assert (beta.float() - ref_beta.float()).abs().max().item() <= beta_ulps * ulp


def check_gdn_gates_from_x(
    module,
    tokens: int,
    heads: int,
    hidden: int,
    dtype: torch.dtype,
    device,
    g_tol: float,
    beta_ulps: int,
) -> None:
    """g and beta from the layer input x [T, hidden] (rows strided: a view of a wider buffer)
    and the stacked b|a weight [2H, hidden], scaled so b and a spread like the gates case's.
    The kernel sums in fp32, then rounds b and a to x's dtype as the product's output is, so
    in half precision each lands on the exact product rounded, or at a rounding boundary on a
    neighbour: g and beta must lie between the gates of the neighbours below and above (the
    `gdn_gates` reference), widened by the gates' own `g_tol` (relative) and `beta_ulps`, and
    g equal those of the rounded exact product within `g_tol` but for rare flips (at most
    5 %, or one). In fp32 no rounding follows the sum: the bounds are the exact product
    +- hidden * eps * sum |w x|, outside which no fp32 summation order lands. Measured from
    the exact product, not from the cuBLAS one, which may reduce split-K partial sums in bf16
    (torch's allow_bf16_reduced_precision_reduction) and so stray further from it."""
    x = torch.randn(tokens, hidden + 8, device=device).to(dtype)[:, :hidden]
    w_ba = (torch.randn(2 * heads, hidden, device=device) * 8 * hidden**-0.5).to(dtype)
    A_log = (torch.randn(heads, device=device) * 0.5).to(dtype)
    dt_bias = torch.linspace(-30, 30, heads, device=device).to(dtype)
    g, beta = module.gdn_gates_from_x(x, w_ba, A_log, dt_bias)
    assert beta.dtype == dtype
    exact = x.double() @ w_ba.double().T
    slack = hidden * torch.finfo(dtype).eps * (x.double().abs() @ w_ba.double().abs().T)
    check_gates_of_product(g, beta, exact, slack, A_log, dt_bias, g_tol, beta_ulps)


def check_gates_of_product(
    g: torch.Tensor,
    beta: torch.Tensor,
    exact: torch.Tensor,
    fp32_slack: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    g_tol: float,
    beta_ulps: int,
) -> None:
    """`check_gdn_gates_from_x`'s bounds on a kernel's g and beta, given the exact b|a product
    (float64 [T, 2H]) and, for fp32 (else None), how far from it an fp32 sum may land; beta's
    dtype is the one b and a were rounded to."""
    dtype = beta.dtype
    tokens, heads = exact.shape[0], exact.shape[1] // 2
    assert g.dtype == torch.float32 and g.shape == (tokens, heads)
    assert beta.shape == (tokens, heads)
    if dtype == torch.float32:
        below, above = (exact - fp32_slack).float(), (exact + fp32_slack).float()
    else:
        nearest = exact.to(dtype)
        below = nearest.nextafter(nearest.new_tensor(-torch.inf))
        above = nearest.nextafter(nearest.new_tensor(torch.inf))
    g_below, beta_below = gates_reference.gdn_gates(*below.chunk(2, dim=-1), A_log, dt_bias)
    g_above, beta_above = gates_reference.gdn_gates(*above.chunk(2, dim=-1), A_log, dt_bias)
    g_low, g_high = torch.minimum(g_below, g_above), torch.maximum(g_below, g_above)
    assert (g >= g_low - g_tol * g_low.abs()).all()
    assert (g <= g_high + g_tol * g_high.abs()).all()
    ulp = torch.finfo(dtype).eps / 2  # beta < 1: one unit in the last place is at most this
    assert (beta.float() >= torch.minimum(beta_below, beta_above).float() - beta_ulps * ulp).all()
    assert (beta.float() <= torch.maximum(beta_below, beta_above).float() + beta_ulps * ulp).all()
    if dtype != torch.float32:
        ref_g, _ = gates_reference.gdn_gates(*nearest.chunk(2, dim=-1), A_log, dt_bias)
        differ = ((g - ref_g).abs() > g_tol * ref_g.abs()).sum().item()
        assert differ <= max(1, 0.05 * g.numel())


def check_fused_groupwise_linear(
    module, format_name: str, m: int, sizes: list[int], k: int, dtype: torch.dtype, device, tol
) -> None:
    """The GEMV over weights stacked by rows (`fuse_linears` of encoded linears): each part of
    its output against the GEMV over that weight alone, and the stacked planes decode to the
    stacked weights bit for bit."""
    fmt = get_format(format_name)
    parts = [fmt.encode(torch.randn(n, k) * k**-0.5) for n in sizes]
    planes = {
        name: torch.cat([part.planes[name] for part in parts]).to(device)
        for name in parts[0].planes
    }
    stacked = EncodedTensor(fmt.name, fmt.layout, (sum(sizes), k), planes)
    assert torch.equal(stacked.decode().cpu(), torch.cat([part.decode() for part in parts]))
    x = torch.randn(m, k, device=device).to(dtype)
    outs = module.groupwise_linear(x, stacked).split(sizes, dim=-1)
    for out, part in zip(outs, parts):
        part.planes = {name: plane.to(device) for name, plane in part.planes.items()}
        assert out.dtype == dtype and out.shape == (m, part.shape[0])
        assert relative_error(out, module.groupwise_linear(x, part)) < tol


def moe_block(hidden: int, num_experts: int, top_k: int, width: int, encoded: bool):
    """A `SparseMoE` on random weights (seed 0; the shared expert as wide as a routed one, its
    gate and up fused); `encoded`: the experts and the shared expert's linears kept in q4."""
    from torch import nn

    from ninfer.models.layers.linear import GroupwiseLinear
    from ninfer.models.layers.moe import GroupwiseExperts, SparseMoE

    torch.manual_seed(0)
    block = SparseMoE(hidden, num_experts, top_k, width, width)
    for param in block.parameters():
        nn.init.normal_(param, std=hidden**-0.5)
    if encoded:
        q4 = get_format("q4_g64_fp16")
        block.experts = GroupwiseExperts(
            range(num_experts),
            q4.encode(block.experts.gate_up_proj.data),
            q4.encode(block.experts.down_proj.data),
        )
        for proj in ("gate_proj", "up_proj", "down_proj"):
            weight = getattr(block.shared_expert, proj).weight.data
            setattr(block.shared_expert, proj, GroupwiseLinear(q4.encode(weight)))
    block.shared_expert.fuse_projections()
    return block


def one_ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype`'s values at each of `values`' magnitudes (fp32)."""
    finfo = torch.finfo(dtype)
    magnitude = values.float().abs().clamp_min(finfo.smallest_normal)
    _, exponent = torch.frexp(magnitude)  # magnitude in [2^(e-1), 2^e)
    return torch.ldexp(torch.full_like(magnitude, finfo.eps), exponent - 1)


def decided_tokens(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T] bool: tokens whose k-th and (k+1)-th largest logits (so probabilities) are further
    apart than the two logits' last bits, so that logits differing from these by at most one
    rounding still choose the same experts."""
    ranked = logits.float().sort(dim=-1, descending=True).values
    if top_k == logits.shape[1]:
        return torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    kth, next_ = ranked[:, top_k - 1], ranked[:, top_k]
    return kth - next_ > one_ulp(kth, logits.dtype) + one_ulp(next_, logits.dtype)


def expected_pair_lists(
    experts: torch.Tensor, first: int, count: int, shared: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pair lists `moe_route` derives from each token's chosen experts (`Routes`)."""
    tokens, top_k = experts.shape
    device = experts.device
    pair_tokens = torch.arange(tokens, device=device).repeat_interleave(top_k)
    pair_experts = (experts.long() - first).clamp(0, count - 1).reshape(-1)
    if shared:
        pair_tokens = torch.cat([pair_tokens, torch.arange(tokens, device=device)])
        pair_experts = torch.cat([pair_experts, pair_experts.new_full((tokens,), count)])
    pairs = torch.arange(pair_tokens.shape[0], device=device)
    return pair_tokens.int(), pair_experts.int(), pairs.int()


def check_moe_router_route(
    module,
    route,
    tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    stacked: bool,
    held: tuple[int, int],
    shared: bool,
    dtype: torch.dtype,
    device,
) -> None:
    """`module.moe_router_route` against F.linear and `route` (a routing of its logits):
    - the logits (the shared gate's included, where `stacked`) within one rounding of
      F.linear's: the fp32 summation orders differ;
    - the routes exactly `route`'s of those logits (weights within one rounding step);
    - against the unfused path (`route` of F.linear's logits): the same experts for every
      token not at a near-tie (`decided_tokens`), weights within what one rounding of the
      logits moves them, and pair lists those of the chosen experts."""
    first, count = held
    rows = num_experts + int(stacked)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    weight = (torch.randn(rows, hidden, device=device) * hidden**-0.5).to(dtype)
    routes, logits = module.moe_router_route(x, weight, num_experts, top_k, first, count, shared)
    check_router_outputs(routes, logits, x, weight, route, num_experts, top_k, held, shared)


def check_router_outputs(
    routes, logits, x, weight, route, num_experts: int, top_k: int, held, shared: bool
) -> None:
    """The comparisons of `check_moe_router_route`, of a router's outputs on input rows x."""
    first, count = held
    dtype, rows = x.dtype, weight.shape[0]
    reference_logits = torch.nn.functional.linear(x, weight)
    assert logits.dtype == dtype and logits.shape == (x.shape[0], rows)
    assert (
        (logits.float() - reference_logits.float()).abs() <= one_ulp(reference_logits, dtype)
    ).all()
    eps = torch.finfo(dtype).eps
    own = route(logits[:, :num_experts], top_k, dtype, first, count, shared)
    for name in ("experts", "pair_tokens", "pair_experts", "pairs"):
        assert getattr(routes, name).dtype == torch.int32
        assert torch.equal(getattr(routes, name), getattr(own, name)), name
    assert routes.weights.dtype == dtype
    torch.testing.assert_close(routes.weights, own.weights, rtol=eps, atol=0)
    ref = route(reference_logits[:, :num_experts], top_k, dtype, first, count, shared)
    decided = decided_tokens(reference_logits[:, :num_experts], top_k)
    assert torch.equal(routes.experts[decided], ref.experts[decided])
    rtol = 2.5 * one_ulp(reference_logits.abs().max(), dtype).item() + eps
    torch.testing.assert_close(routes.weights[decided], ref.weights[decided], rtol=rtol, atol=0)
    for name, expected in zip(
        ("pair_tokens", "pair_experts", "pairs"),
        expected_pair_lists(routes.experts, first, count, shared),
    ):
        assert torch.equal(getattr(routes, name), expected), name


def check_moe_norm_router_route(
    module,
    norm_module,
    route,
    tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    held: tuple[int, int],
    shared: bool,
    dtype: torch.dtype,
    device,
) -> None:
    """`module.moe_norm_router_route` (the norm before a MoE block inside the fused router)
    against `norm_module.rms_norm` (the norm kernel), then the router's comparisons
    (`check_router_outputs`) on the rows it wrote:
    - the residual sum exactly the norm kernel's; the normed rows within one rounding of its
      (on the GPU the fp32 sum of squares is added in another order), nearly all equal;
    - the logits within one rounding of F.linear's on the normed rows, the routes exactly
      `route`'s of those logits, the experts of F.linear's away from near-ties."""
    x = (torch.randn(tokens, hidden, device=device) * 2).to(dtype)
    residual = torch.randn(tokens, hidden, device=device).to(dtype)
    norm_weight = (torch.randn(hidden, device=device) * 0.1).to(dtype)
    weight = (torch.randn(num_experts + 1, hidden, device=device) * hidden**-0.5).to(dtype)
    held_and_shared = (*held, shared)
    routes, logits, normed, total = module.moe_norm_router_route(
        x, residual, norm_weight, 1e-6, weight, num_experts, top_k, *held_and_shared
    )
    ref_normed, ref_total = norm_module.rms_norm(x, norm_weight, 1e-6, residual)
    assert total.dtype == normed.dtype == dtype and normed.shape == total.shape == x.shape
    assert torch.equal(total, ref_total)
    assert ((normed.float() - ref_normed.float()).abs() <= one_ulp(ref_normed, dtype)).all()
    assert (normed == ref_normed).float().mean() > 0.99
    check_router_outputs(routes, logits, normed, weight, route, num_experts, top_k, held, shared)
