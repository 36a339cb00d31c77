"""The decode delta rule with the GDN gates computed inside its kernel
(`recurrent_gated_delta_rule_from_x`), run by Triton's CPU interpreter on tiny shapes: bit for
bit the gates-from-x kernel followed by the delta-rule kernel it replaces, and within the
delta rule's tolerances of the torch reference. Half precision is fp16
(tests/triton_interpreter.py says why); bf16 at the model shapes runs in tests/gpu."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import check_gdn_recurrent_from_x, check_gdn_recurrent_from_x_normed
from triton_interpreter import load_kernel_module, require_interpreter

require_interpreter()


@pytest.fixture
def interpreted():
    torch.manual_seed(0)
    return load_kernel_module


@pytest.mark.parametrize("early", [False, True], ids=["gates-after-wait", "gates-before-wait"])
@pytest.mark.parametrize("query_lens", [[1], [1, 1, 1], [1, 2, 1]], ids=["1", "3", "3-verify"])
@pytest.mark.parametrize("value_heads_per_key_head", [1, 2])
@pytest.mark.parametrize("hidden", [300, 2500])
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [pytest.param(torch.float16, 1e-3, id="fp16"), pytest.param(torch.float32, 1e-5, id="fp32")],
)
def test_gates_inside_the_rule_give_the_two_launches_bit_for_bit(
    interpreted, query_lens, value_heads_per_key_head, hidden, dtype, tol, early, monkeypatch
):
    """Hidden within one column block of the dot product (300, masked) and over three (2500);
    [1, 2, 1]: a sequence of two tokens, as speculative verification steps it. With
    `GATES_BEFORE_WAIT` one token's gates are computed before the kernel's wait."""
    module = interpreted("gdn_recurrent_triton")
    monkeypatch.setattr(module, "GATES_BEFORE_WAIT", early)
    check_gdn_recurrent_from_x(
        module,
        interpreted("gdn_gates_triton"),
        query_lens,
        2,
        2 * value_heads_per_key_head,
        16,
        32,
        hidden,
        dtype,
        "cpu",
        tol,
    )


@pytest.mark.parametrize("early", [False, True], ids=["reads-late", "reads-early"])
@pytest.mark.parametrize("mailbox", [True, False], ids=["mailbox", "counter"])
@pytest.mark.parametrize("value_heads", [2, 4], ids=["4-blocks-a-head", "2-blocks-a-head"])
@pytest.mark.parametrize("split", [None, (4, 64), (8, 32)], ids=["no-codes", "q4", "q8"])
@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32")]
)
def test_output_norm_in_the_rule_gives_the_two_launches_bit_for_bit(
    interpreted, value_heads, split, dtype, mailbox, early, monkeypatch
):
    """At one token each head's last column block runs the output norm
    (`recurrent_gated_delta_rule_from_x_normed`) once the head's o is in its mailbox (a
    16-bit o; fp32 takes the counter) or, with the mailbox off, the last block to arrive at
    the head's counter does: the norm kernel's output and codes, the same states, for one
    head's columns split over four or two programs (the interpreter's eight SMs narrow the
    blocks to 16 or 32 of 64 columns). The mailbox and the counters are left at zero.
    `early`: the gates computed before the wait, the norm's z and weight read before the rule
    (`GATES_BEFORE_WAIT`, `NORM_INPUTS_EARLY`)."""
    from ninfer.kernels.groupwise_gemv_triton import _counters
    from ninfer.kernels.x_split import SplitRequest

    module = interpreted("gdn_recurrent_triton")
    monkeypatch.setattr(module, "NORM_MAILBOX", mailbox)
    monkeypatch.setattr(module, "GATES_BEFORE_WAIT", early)
    monkeypatch.setattr(module, "NORM_INPUTS_EARLY", early)
    request = SplitRequest(*split, 1) if split else None
    check_gdn_recurrent_from_x_normed(
        module,
        interpreted("gated_rms_norm_triton"),
        1,
        value_heads,
        16,
        64,
        300,
        request,
        dtype,
        "cpu",
    )
    used = mailbox and dtype == torch.float16
    assert (torch.device("cpu") in module._mailboxes) == used
    assert not any(box.any() for box in module._mailboxes.values())
    assert not _counters[torch.device("cpu")].any()


def test_output_norm_left_to_its_kernel_past_the_block_limit(interpreted):
    """A head in more column blocks than `NORM_LAST_MAX_BLOCKS` (four of 16 columns here, the
    limit two): the kernel does not take the step (None), and the dispatch's form gives the
    rule and the norm apart."""
    from ninfer.kernels import dispatch, gdn_recurrent_triton

    module = interpreted("gdn_recurrent_triton")
    module.NORM_LAST_MAX_BLOCKS = 2
    assert gdn_recurrent_triton.NORM_LAST_MAX_BLOCKS == 4
    q, k, v = (torch.randn(1, heads, 64) for heads in (1, 1, 2))
    x, ba = torch.randn(1, 300), torch.randn(4, 300) * 0.1
    A_log, dt_bias = torch.randn(2), torch.randn(2)
    states = torch.randn(3, 2, 64, 64)
    slots, starts = torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    z, weight = torch.randn(1, 2, 64), torch.randn(64)
    args = (q, k, v, x, ba, A_log, dt_bias, states, slots, starts, z, weight, 1e-6)
    assert module.recurrent_gated_delta_rule_from_x_normed(*args) is None
    module.NORM_LAST_MAX_BLOCKS = 4
    assert module.recurrent_gated_delta_rule_from_x_normed(*args) is not None
    normed = dispatch.recurrent_gated_delta_rule_from_x_normed(*args)  # on the CPU: apart
    assert normed.shape == v.shape
