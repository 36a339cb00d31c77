"""One entry point per kernel: CUDA tensors (with Triton present) go to the Triton kernel, the
rest to the torch reference, which is also the CPU path. Triton modules are imported on first
use, so CPU-only installs never import Triton. Kernels whose matrix products would run in tf32
(attention, fla's GDN chunks) take half precision only: fp32 runs keep the exact reference."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.kernels import attention_prelude as prelude_reference
from ninfer.kernels import causal_conv1d as conv_reference
from ninfer.kernels import gdn_chunked as chunked_reference
from ninfer.kernels import gdn_gates as gates_reference
from ninfer.kernels import gdn_recurrent as gdn_reference
from ninfer.kernels import groupwise_dequant as dequant_reference
from ninfer.kernels import groupwise_gemv as gemv_reference
from ninfer.kernels import moe_combine as combine_reference
from ninfer.kernels import moe_router as router_reference
from ninfer.kernels import moe_routing as routing_reference
from ninfer.kernels import output_gate as output_gate_reference
from ninfer.kernels import paged_attention as attention_reference
from ninfer.kernels import rms_norm as norm_reference
from ninfer.kernels import swiglu as swiglu_reference
from ninfer.kernels.gdn_chunked_fla import HAS_FLA
from ninfer.kernels.kernel_cache import persist_triton_cache
from ninfer.kernels.moe_routing import Routes
from ninfer.kernels.norm_fold import FOLDED_ROWS, HeadNormedRows, NormAfter, NormedRows
from ninfer.kernels.triton_support import HAS_TRITON, use_triton
from ninfer.kernels.x_split import SplitRequest, blocks_hold_groups
from ninfer.quant import EncodedTensor

_HALF = (torch.bfloat16, torch.float16)
_DENSE = (*_HALF, torch.float32)

persist_triton_cache()  # compiled kernels and autotune results survive restarts


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    if use_triton(q, k_cache) and q.dtype in _HALF and k_cache.dtype == q.dtype:
        from ninfer.kernels import paged_attention_triton

        return paged_attention_triton.paged_attention_decode(
            q, k_cache, v_cache, page_table, seq_lens, scale, max_seq_len
        )
    return attention_reference.paged_attention_decode(
        q, k_cache, v_cache, page_table, seq_lens, scale
    )


def paged_attention_decode_gated(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor,
    split: SplitRequest | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """`sigmoid_gate(paged_attention_decode(...), gate, split)`, [B, heads * head_dim]. On
    CUDA one kernel fewer: the attention's merge kernel applies the gate (and writes o_proj's
    codes where a head holds whole groups of them; else the two kernels run)."""
    rows, heads, head_dim = q.shape
    if (
        use_triton(q, k_cache, gate)
        and q.dtype in _HALF
        and k_cache.dtype == q.dtype
        and gate.dtype == q.dtype
        and gate.stride(-1) == 1
        and (
            split is None
            or not split.wanted(rows, heads * head_dim)
            or blocks_hold_groups(split, head_dim)
        )
    ):
        from ninfer.kernels import paged_attention_triton

        return paged_attention_triton.paged_attention_decode_gated(
            q, k_cache, v_cache, page_table, seq_lens, scale, gate, split, max_seq_len
        )
    out = paged_attention_decode(q, k_cache, v_cache, page_table, seq_lens, scale, max_seq_len)
    return sigmoid_gate(out, gate, split)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    if use_triton(q, k_cache) and q.dtype in _HALF and k_cache.dtype == q.dtype:
        from ninfer.kernels import paged_attention_prefill_triton

        return paged_attention_prefill_triton.paged_attention_prefill(
            q, k_cache, v_cache, page_table, query_start, context_lens, seq_lens, scale
        )
    return attention_reference.paged_attention_prefill(
        q, k_cache, v_cache, page_table, query_start, context_lens, seq_lens, scale
    )


def attention_prelude(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_write_slots: torch.Tensor,
) -> torch.Tensor:
    """An attention layer's q/k norms, rotary and K/V write (`attention_prelude`): one Triton
    kernel on CUDA. Returns the normed, rotated query; the key goes to the pages only."""
    module = prelude_reference
    tensors = (query, key, value, cos, sin, k_cache, v_cache)
    if use_triton(*tensors) and all(t.stride(-1) == 1 for t in tensors):
        from ninfer.kernels import attention_prelude_triton as module
    return module.attention_prelude(
        query, key, value, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, kv_write_slots
    )


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
) -> torch.Tensor:
    """Prefill form of the gated delta rule: fla-core's chunk kernels on CUDA (when installed),
    else the torch reference."""
    if HAS_FLA and use_triton(q, states) and v.dtype in _HALF:
        from ninfer.kernels import gdn_chunked_fla

        return gdn_chunked_fla.chunk_gated_delta_rule(
            q, k, v, g, beta, states, state_slots, query_start
        )
    return chunked_reference.chunk_gated_delta_rule(
        q, k, v, g, beta, states, state_slots, query_start
    )


def warm_up_chunk_gated_delta_rule(
    num_key_heads: int,
    num_value_heads: int,
    key_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> bool:
    """Autotune fla's chunk kernels for one GDN head shape when `chunk_gated_delta_rule` would
    run them on `device` in `dtype`; returns whether it did."""
    device = torch.device(device)
    if not (HAS_FLA and HAS_TRITON and device.type == "cuda" and dtype in _HALF):
        return False
    from ninfer.kernels import gdn_chunked_fla

    gdn_chunked_fla.warm_up(num_key_heads, num_value_heads, key_dim, value_dim, dtype, device)
    return True


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
) -> torch.Tensor:
    module = gdn_reference
    if use_triton(q, states):
        from ninfer.kernels import gdn_recurrent_triton as module
    return module.recurrent_gated_delta_rule(q, k, v, g, beta, states, state_slots, query_start)


def recurrent_gated_delta_rule_normed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> HeadNormedRows:
    """`recurrent_gated_delta_rule` with the GDN output norm (gate z, weight) folded into its
    output for the out projection to finish (`norm_fold.HeadNormedRows`): on CUDA in the
    recurrent kernel, else the rule, then `norm_fold.fold_gated_norm`."""
    if use_triton(q, states, z, norm_weight) and z.stride(-1) == 1:
        from ninfer.kernels import gdn_recurrent_triton

        return gdn_recurrent_triton.recurrent_gated_delta_rule_normed(
            q, k, v, g, beta, states, state_slots, query_start, z, norm_weight, eps
        )
    from ninfer.kernels import norm_fold

    out = recurrent_gated_delta_rule(q, k, v, g, beta, states, state_slots, query_start)
    return norm_fold.fold_gated_norm(out, z, norm_weight, eps, out.shape[-1])


def recurrent_gated_delta_rule_from_x(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor,
    ba_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
) -> torch.Tensor:
    """The decode delta rule with the gates from the layer input x [T, hidden] and the stacked
    b|a weight [2Hv, hidden]: on CUDA one kernel computes b|a product, gates and recurrence
    (for decode-sized T: the caller decides), else `gdn_gates_from_x` and the rule."""
    if _takes_b_a_product(x, ba_weight, q, A_log, dt_bias, states):
        from ninfer.kernels import gdn_recurrent_triton

        return gdn_recurrent_triton.recurrent_gated_delta_rule_from_x(
            q, k, v, x, ba_weight, A_log, dt_bias, states, state_slots, query_start
        )
    return gdn_reference.recurrent_gated_delta_rule_from_x(
        q, k, v, x, ba_weight, A_log, dt_bias, states, state_slots, query_start
    )


def recurrent_gated_delta_rule_from_x_normed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor,
    ba_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    split: SplitRequest | None = None,
) -> torch.Tensor:
    """`recurrent_gated_delta_rule_from_x`, then the GDN output norm of its o with gate z
    [T, Hv, dv] (`gated_rms_norm`, the codes `split` asks for attached): the norm's output. On
    CUDA at one token, where a head is in at most `gdn_recurrent_triton.NORM_LAST_MAX_BLOCKS`
    column blocks, one kernel runs both (each head's last column block the norm); else the two
    apart."""
    if _takes_b_a_product(x, ba_weight, q, A_log, dt_bias, states) and use_triton(z, norm_weight):
        from ninfer.kernels import gdn_recurrent_triton

        normed = gdn_recurrent_triton.recurrent_gated_delta_rule_from_x_normed(
            q,
            k,
            v,
            x,
            ba_weight,
            A_log,
            dt_bias,
            states,
            state_slots,
            query_start,
            z,
            norm_weight,
            eps,
            split,
        )
        if normed is not None:
            return normed
    out = recurrent_gated_delta_rule_from_x(
        q, k, v, x, ba_weight, A_log, dt_bias, states, state_slots, query_start
    )
    return gated_rms_norm(out, z, norm_weight, eps, split)


def _takes_b_a_product(
    x: torch.Tensor | NormedRows, w_ba: torch.Tensor, *others: torch.Tensor
) -> bool:
    """Whether a Triton kernel computes the GDN b|a product of x itself: x in a dense dtype,
    the weight in x's, both unit stride along hidden, and every tensor (others too) on CUDA.
    x may be a folded norm's rows (`norm_fold`)."""
    if isinstance(x, NormedRows):
        others = (*others, x.squares)
        x = x.weighted
    return (
        use_triton(x, w_ba, *others)
        and x.dtype in _DENSE
        and w_ba.dtype == x.dtype
        and x.stride(-1) == 1
        and w_ba.stride(-1) == 1
    )


def gdn_gates(
    b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g fp32, beta in b's dtype) of the GDN layer from its b and a projections [T, H]."""
    module = gates_reference
    if use_triton(b, a, A_log, dt_bias) and b.stride(-1) == 1 and a.stride(-1) == 1:
        from ninfer.kernels import gdn_gates_triton as module
    return module.gdn_gates(b, a, A_log, dt_bias)


def gdn_gates_from_x(
    x: torch.Tensor | NormedRows, w_ba: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g fp32, beta in x's dtype) of the GDN layer from its input x [T, hidden] (or a folded
    norm's rows) and the stacked b|a weight [2H, hidden]: on CUDA one kernel computes the
    product and the gates (for decode-sized T: the caller decides), else the product, its
    halves, `gdn_gates`."""
    if _takes_b_a_product(x, w_ba, A_log, dt_bias):
        from ninfer.kernels import gdn_gates_triton

        return gdn_gates_triton.gdn_gates_from_x(x, w_ba, A_log, dt_bias)
    if isinstance(x, NormedRows):
        x = x.materialize()
    return gates_reference.gdn_gates_from_x(x, w_ba, A_log, dt_bias)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_windows: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
) -> torch.Tensor:
    module = conv_reference
    if use_triton(x, conv_windows):
        from ninfer.kernels import causal_conv1d_triton as module
    return module.causal_conv1d(x, weight, conv_windows, state_slots, query_start)


def causal_conv1d_and_gates(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_windows: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
    ba_x: torch.Tensor | NormedRows,
    w_ba: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`causal_conv1d` of x and `gdn_gates_from_x` of ba_x (the GDN layer's input, maybe a
    folded norm's rows): (conv output, g, beta). On CUDA one kernel runs both (for
    decode-sized batches: the caller decides), else the two entry points."""
    if _takes_b_a_product(ba_x, w_ba, x, conv_windows, A_log, dt_bias):
        from ninfer.kernels import causal_conv1d_triton

        return causal_conv1d_triton.causal_conv1d_and_gates(
            x, weight, conv_windows, state_slots, query_start, ba_x, w_ba, A_log, dt_bias
        )
    g, beta = gdn_gates_from_x(ba_x, w_ba, A_log, dt_bias)
    return causal_conv1d(x, weight, conv_windows, state_slots, query_start), g, beta


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    split: SplitRequest | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`split`: the integer-GEMV codes the output's consumer wants written beside it
    (`x_split`; the Triton kernel only)."""
    if use_triton(x):
        from ninfer.kernels import rms_norm_triton

        return rms_norm_triton.rms_norm(x, weight, eps, residual, split)
    return norm_reference.rms_norm(x, weight, eps, residual)


def gated_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    split: SplitRequest | None = None,
) -> torch.Tensor:
    """The GDN output norm: RMSNorm of each head's row of x, times weight, times silu(z)."""
    if use_triton(x, z, weight):
        from ninfer.kernels import gated_rms_norm_triton

        return gated_rms_norm_triton.gated_rms_norm(x, z, weight, eps, split)
    from ninfer.kernels import gated_rms_norm as reference

    return reference.gated_rms_norm(x, z, weight, eps)


def groupwise_linear(
    x: torch.Tensor | NormedRows | HeadNormedRows, weight: EncodedTensor
) -> torch.Tensor:
    """x [M, K] @ W.T for an encoded [N, K] weight. x may be a folded norm's rows
    (`norm_fold`): the Gluon product takes their factors; any other kernel reads them
    materialized."""
    if isinstance(x, FOLDED_ROWS):
        if _takes_normed_rows(x, weight):
            from ninfer.kernels import groupwise_gemv_gluon

            return groupwise_gemv_gluon.q4_linear(x, weight)
        x = x.materialize()
    if use_triton(x) and x.dtype in _HALF:
        from ninfer.kernels import groupwise_gemv_triton

        if weight.format in groupwise_gemv_triton.SUPPORTED:
            return groupwise_gemv_triton.groupwise_linear(x, weight)
        if takes_q6_linear(x, weight):
            from ninfer.kernels import groupwise_gemv_gluon

            return groupwise_gemv_gluon.q6_linear(x, weight)
    return gemv_reference.groupwise_linear(x, weight)


def takes_q6_linear(x: torch.Tensor, weight: EncodedTensor) -> bool:
    """Whether `groupwise_linear` reads this q6_g64 weight as stored: two to eight bf16 rows on
    a Hopper GPU (the Gluon kernel). One row is the integer GEMV's (`integer_linear`)."""
    if weight.format != "q6_g64_fp16" or not use_triton(x, *weight.planes.values()):
        return False
    from ninfer.kernels import groupwise_gemv_gluon

    return groupwise_gemv_gluon.fits(x, weight)


def _takes_normed_rows(x: NormedRows | HeadNormedRows, weight: EncodedTensor) -> bool:
    if not (use_triton(x.weighted, x.squares, *weight.planes.values()) and x.dtype in _HALF):
        return False
    from ninfer.kernels import groupwise_gemv_gluon

    return groupwise_gemv_gluon.fits_normed(x, weight)


def groupwise_linear_then_norm(
    x: torch.Tensor | HeadNormedRows, weight: EncodedTensor, after: NormAfter
) -> tuple[NormedRows, torch.Tensor]:
    """(norm(x @ W.T + residual) as `NormedRows`, x @ W.T + residual): a product with the
    RMSNorm after it folded into its epilogue (`norm_fold`) where the Gluon q4 product takes
    it (`groupwise_gemv_gluon.takes_norm_after`), else the product, then
    `norm_fold.fold_norm`. x may be the GDN output norm's folded rows
    (`norm_fold.HeadNormedRows`)."""
    from ninfer.kernels import norm_fold

    rows, n = x.shape[0], weight.shape[0]
    plain = x.weighted if isinstance(x, HeadNormedRows) else x
    if (
        after.residual.shape == (rows, n)
        and after.residual.is_contiguous()
        and after.residual.dtype == x.dtype
        and after.weight.is_contiguous()
        and use_triton(plain, after.residual, after.weight, *weight.planes.values())
    ):
        from ninfer.kernels import groupwise_gemv_gluon

        if groupwise_gemv_gluon.takes_norm_after(x, weight):
            return groupwise_gemv_gluon.q4_linear(x, weight, after)
    return norm_fold.fold_norm(groupwise_linear(x, weight), after, norm_fold.REFERENCE_BLOCK)


def takes_norm_folds(x: torch.Tensor) -> bool:
    """Whether a decoder layer's norms are folded into the products beside them for rows like
    x's (`norm_fold`): two to eight bf16 rows on a GPU where the Gluon product runs."""
    if not (use_triton(x) and x.dtype == torch.bfloat16):
        return False
    from ninfer.kernels import groupwise_gemv_gluon

    return groupwise_gemv_gluon.runs(x)


def norm_folds_fit(weights: Sequence[EncodedTensor]) -> bool:
    """Whether the Gluon product takes each of these weights (the products on either side of a
    folded norm, `norm_fold`): q4_g64 of a width it reads. Whether a step's rows fit is
    `takes_norm_folds`'s question."""
    if not HAS_TRITON:
        return False
    from ninfer.kernels import groupwise_gemv_gluon

    return all(
        weight.format == "q4_g64_fp16" and groupwise_gemv_gluon.takes_weight(weight)
        for weight in weights
    )


def swiglu_linear(x: torch.Tensor | NormedRows, weight: EncodedTensor) -> torch.Tensor:
    """silu(gate) * up, [M, F], for x [M, K] and an encoded [2F, K] weight stacking gate's rows
    over up's. Where `takes_swiglu_linear`, one kernel with the SwiGLU in its epilogue, bit for
    bit the product followed by `silu_mul`; elsewhere the product, then `silu_mul`. x may be a
    folded norm's rows, as for `groupwise_linear`."""
    if takes_swiglu_linear(x, weight):
        from ninfer.kernels import groupwise_gemv_gluon

        return groupwise_gemv_gluon.q4_swiglu_linear(x, weight)
    if isinstance(x, NormedRows):
        x = x.materialize()
    if use_triton(x) and x.dtype in _HALF:
        gate, up = groupwise_linear(x, weight).chunk(2, dim=-1)
        return silu_mul(gate, up)
    return gemv_reference.swiglu_linear(x, weight)


def takes_swiglu_linear(x: torch.Tensor | NormedRows, weight: EncodedTensor) -> bool:
    """Whether `swiglu_linear` runs as one kernel: the Gluon q4 product's conditions (two to
    eight bf16 rows on a Hopper GPU, `groupwise_gemv_gluon.swiglu_fits`)."""
    rows = x.weighted if isinstance(x, NormedRows) else x
    if not (use_triton(rows, *weight.planes.values()) and x.dtype in _HALF):
        return False
    from ninfer.kernels import groupwise_gemv_gluon

    return groupwise_gemv_gluon.swiglu_fits(rows, weight)


def integer_linear(x: torch.Tensor, weight: EncodedTensor) -> torch.Tensor:
    """x [M, K] @ W.T through the integer GEMV, which also reads formats the tensor-core kernel
    does not (q6_g64, `groupwise_gemv_triton.ONE_ROW_FORMATS`); the reference elsewhere."""
    if use_triton(x) and x.dtype in _HALF:
        from ninfer.kernels import groupwise_gemv_triton

        if weight.format in groupwise_gemv_triton.ONE_ROW_FORMATS:
            return groupwise_gemv_triton.integer_linear(x, weight)
    return gemv_reference.groupwise_linear(x, weight)


def grouped_groupwise_linear(
    x: torch.Tensor, weight: EncodedTensor, x_rows: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """MoE experts: row p of the [P, N] result is W[experts[p]] @ x[x_rows[p]] for stacked
    encoded experts W [E, N, K]. The Triton form reads the ids on the device (no host sync)."""
    if use_triton(x, *weight.planes.values()) and x.dtype in _HALF:
        from ninfer.kernels import groupwise_gemv_triton

        if weight.format in groupwise_gemv_triton.SUPPORTED:
            return groupwise_gemv_triton.grouped_groupwise_linear(x, weight, x_rows, experts)
    return gemv_reference.grouped_groupwise_linear(x, weight, x_rows, experts)


def grouped_swiglu_linear(
    gate_up: torch.Tensor,
    weight: EncodedTensor,
    x_rows: torch.Tensor,
    experts: torch.Tensor,
    split: SplitRequest | None = None,
) -> torch.Tensor:
    """MoE experts' down projection of their SwiGLU: gate_up [T, 2K] the gate|up product's
    rows (gate, then up); row p of the [P, N] result is W[experts[p]] @ silu(gate) * up of row
    x_rows[p]. The Triton form computes the activation inside the product where the kernel
    reads a row whole (`groupwise_gemv_triton.swiglu_fits`: the 35B-A3B experts' K = 512);
    otherwise `silu_mul` (writing the codes `split` asks for) and the grouped product."""
    if use_triton(gate_up, *weight.planes.values()) and gate_up.dtype in _HALF:
        from ninfer.kernels import groupwise_gemv_triton

        if groupwise_gemv_triton.swiglu_fits(weight):
            return groupwise_gemv_triton.grouped_swiglu_linear(gate_up, weight, x_rows, experts)
    gate, up = gate_up.chunk(2, dim=-1)
    return grouped_groupwise_linear(silu_mul(gate, up, split), weight, x_rows, experts)


def grouped_swiglu_combine(
    gate_up: torch.Tensor,
    weight: EncodedTensor,
    routes,
    first: int,
    count: int,
    shared_gate: torch.Tensor,
    split: SplitRequest | None = None,
) -> torch.Tensor:
    """One MoE token's block output [1, N] from its pairs' gate|up rows [k + 1, 2K] (`routes`
    with the shared expert's pair last): `grouped_swiglu_linear` over the pairs, then
    `moe_combine`. On CUDA one Triton kernel runs both where it takes them
    (`groupwise_gemv_triton.grouped_swiglu_combine`), bit for bit the two."""
    if use_triton(gate_up, *weight.planes.values()) and gate_up.dtype in _HALF:
        from ninfer.kernels import groupwise_gemv_triton

        out = groupwise_gemv_triton.grouped_swiglu_combine(
            gate_up, weight, routes, first, count, shared_gate
        )
        if out is not None:
            return out
    outputs = grouped_swiglu_linear(gate_up, weight, routes.pairs, routes.pair_experts, split)
    top_k = routes.weights.shape[1]
    return moe_combine(
        outputs[:top_k].view(1, top_k, -1),
        routes.weights,
        routes.experts,
        first,
        count,
        outputs[top_k:],
        shared_gate,
    )


def groupwise_linear_conv(
    x: torch.Tensor,
    weight: EncodedTensor,
    conv_weight: torch.Tensor,
    conv_windows: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A GDN in projection (stacked q|k|v|z rows, encoded) and the causal conv of its first
    conv_weight.shape[0] outputs: (silu(conv(q|k|v)), z). On CUDA, for one token and taps of
    width 4, the conv runs in the integer GEMV's kernel (one launch); else the product, then
    `causal_conv1d`."""
    channels, width = conv_weight.shape
    if (
        use_triton(x, conv_windows)
        and x.dtype in _HALF
        and x.shape[0] == 1
        and state_slots.shape[0] == 1
        and width == 4
        and conv_weight.stride(1) == 1
        and conv_windows.stride(2) == 1
    ):
        from ninfer.kernels import groupwise_gemv_triton

        if weight.format in groupwise_gemv_triton.SUPPORTED:
            out = groupwise_gemv_triton.integer_linear_conv(
                x.contiguous(), weight, conv_weight, conv_windows, state_slots
            )
            return out[:, :channels], out[:, channels:]
    out = groupwise_linear(x, weight)
    mixed = causal_conv1d(out[:, :channels], conv_weight, conv_windows, state_slots, query_start)
    return mixed, out[:, channels:]


def groupwise_linear_conv_and_gates(
    x: torch.Tensor | NormedRows,
    weight: EncodedTensor,
    conv_weight: torch.Tensor,
    conv_windows: torch.Tensor,
    state_slots: torch.Tensor,
    w_ba: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A GDN in projection (stacked q|k|v|z rows, encoded) at a decode step (one token a
    sequence, state_slots[m] x row m's), the causal conv of its first conv_weight.shape[0]
    outputs and the gates from x (maybe a folded norm's rows), in one kernel: (silu(conv(q|k|v)),
    z, g, beta). Where the Gluon product takes it (two to eight rows on Hopper,
    `groupwise_gemv_gluon.takes_conv`); else None, and the caller runs them apart."""
    rows = x.weighted if isinstance(x, NormedRows) else x
    if not use_triton(rows, conv_windows, w_ba, *weight.planes.values()):
        return None
    from ninfer.kernels import groupwise_gemv_gluon as gluon_gemv

    conv = gluon_gemv.GdnConv(conv_weight, conv_windows, state_slots)
    gates = gluon_gemv.GdnGates(w_ba, A_log, dt_bias)
    if not gluon_gemv.takes_conv(x, weight, conv, gates):
        return None
    out, (g, beta) = gluon_gemv.q4_linear_conv(x, weight, conv, gates)
    channels = conv_weight.shape[0]
    return out[:, :channels], out[:, channels:], g, beta


def groupwise_dequant(weight: EncodedTensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] form of an encoded weight in `dtype`, bit-identical on both paths."""
    if use_triton(*weight.planes.values()):
        from ninfer.kernels import groupwise_dequant_triton as module

        if weight.format in module.SUPPORTED and dtype in module.DTYPES:
            return module.groupwise_dequant(weight, dtype)
    return dequant_reference.groupwise_dequant(weight, dtype)


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor, split: SplitRequest | None = None
) -> torch.Tensor:
    if use_triton(gate, up) and gate.stride(-1) == 1 and up.stride(-1) == 1:
        from ninfer.kernels import swiglu_triton

        return swiglu_triton.silu_mul(gate, up, split)
    return swiglu_reference.silu_mul(gate, up)


def sigmoid_gate(
    attn: torch.Tensor, gate: torch.Tensor, split: SplitRequest | None = None
) -> torch.Tensor:
    """The gated-attention output: attn * sigmoid(gate), [T, heads * head_dim]."""
    if use_triton(attn, gate) and gate.stride(-1) == 1 and attn.dtype == gate.dtype:
        from ninfer.kernels import output_gate_triton

        return output_gate_triton.sigmoid_gate(attn, gate, split)
    return output_gate_reference.sigmoid_gate(attn, gate)


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    dtype: torch.dtype,
    first: int,
    count: int,
    shared: bool = False,
) -> Routes:
    """MoE routing (`moe_routing.moe_route`): one Triton kernel on CUDA."""
    module = routing_reference
    if use_triton(logits) and logits.stride(-1) == 1:
        from ninfer.kernels import moe_routing_triton as module
    return module.moe_route(logits, top_k, dtype, first, count, shared)


def moe_router_route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    num_experts: int,
    top_k: int,
    first: int,
    count: int,
    shared: bool = False,
) -> tuple[Routes, torch.Tensor]:
    """The routes and the router's logits (`moe_router.moe_router_route`): one Triton kernel on
    CUDA for x and router in one half-precision dtype (for decode-sized T: the caller
    decides)."""
    module = router_reference
    if (
        use_triton(x, router_weight)
        and x.dtype in _HALF
        and router_weight.dtype == x.dtype
        and x.stride(-1) == 1
        and router_weight.stride(-1) == 1
    ):
        from ninfer.kernels import moe_router_triton as module
    return module.moe_router_route(x, router_weight, num_experts, top_k, first, count, shared)


def moe_norm_router_route(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router_weight: torch.Tensor,
    num_experts: int,
    top_k: int,
    first: int,
    count: int,
    shared: bool = False,
    split: SplitRequest | None = None,
) -> tuple[Routes, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The norm before a MoE block and its router (`moe_router.moe_norm_router_route`): one
    Triton kernel on CUDA under `moe_router_route`'s conditions, with the norm's input and
    residual in the router's dtype; `split` as `rms_norm`'s."""
    tensors = (x, residual, norm_weight, router_weight)
    if (
        use_triton(*tensors)
        and x.dtype in _HALF
        and residual.dtype == router_weight.dtype == x.dtype
        and all(t.stride(-1) == 1 for t in tensors)
    ):
        from ninfer.kernels import moe_router_triton

        return moe_router_triton.moe_norm_router_route(
            *tensors[:3], eps, router_weight, num_experts, top_k, first, count, shared, split
        )
    return router_reference.moe_norm_router_route(
        *tensors[:3], eps, router_weight, num_experts, top_k, first, count, shared
    )


def moe_combine(
    choices: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    first: int,
    count: int,
    shared: torch.Tensor,
    shared_gate: torch.Tensor,
) -> torch.Tensor:
    """A MoE block's output (`moe_combine.moe_combine`): one Triton kernel on CUDA."""
    module = combine_reference
    if use_triton(choices, shared) and choices.stride(-1) == 1 and shared.stride(-1) == 1:
        from ninfer.kernels import moe_combine_triton as module
    return module.moe_combine(choices, weights, experts, first, count, shared, shared_gate)
