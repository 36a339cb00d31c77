"""The GPU's decode path of a q4 model, run on the CPU: every kernel dispatched to its Triton
form under Triton's interpreter (paged prefill and decode attention, K/V write, GDN gates,
conv and recurrent kernels, norms, SwiGLU, output gate, the integer GEMV at one row and the
tensor-core GEMV at four), fp16, inference mode, linears kept in q4. Its logits over a
prefill and three decode steps stay within fp16's error of the fp32 reference path on the same
dequantized weights (the GPU tests compare the compiled kernels the same way)."""

from __future__ import annotations

import torch
from tiny_qwen import (
    Runner,
    convert_to_artifact,
    keep_linears_in_q4,
    load_ours,
    make_hf_model,
    rel_err,
)
from triton_interpreter import require_interpreter

require_interpreter()

from ninfer.kernels import dispatch  # noqa: E402 (after the interpreter is switched on)


def test_q4_model_through_every_triton_kernel_matches_the_reference(monkeypatch, tmp_path):
    artifact = convert_to_artifact(
        make_hf_model("dense_3gdn_1attn_gqa2", hidden_size=128), tmp_path
    )
    reference, model = load_ours(artifact, torch.float32), load_ours(artifact, torch.float16)
    keep_linears_in_q4(model, reference)
    steps = ([3, 17, 40, 5], [9], [21], [7])

    def run(m) -> list[torch.Tensor]:
        runner = Runner(m)
        runner.add("a")
        with torch.inference_mode():
            return [runner.step({"a": ids})["a"] for ids in steps]

    expected = run(reference)
    monkeypatch.setattr(dispatch, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(dispatch, "HAS_FLA", False)  # fla's prefill does not run here
    for got, want in zip(run(model), expected):
        assert rel_err(got, want) < 2e-2
