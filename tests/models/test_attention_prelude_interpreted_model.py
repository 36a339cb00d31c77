"""The fused attention prelude in a whole model under Triton's CPU interpreter, every kernel
dispatched to its Triton form, in fp16 as the engine runs: a prompt in two chunks and decode
steps give the same logits, bit for bit, as with the unfused norm, rotary and K/V-write kernels
it replaced (GQA 2:1, head_dim 32, rotary over 8 of its dims)."""

from __future__ import annotations

import torch
from kernel_cases import composed_prelude
from tiny_qwen import Runner, convert_to_artifact, load_ours, make_hf_model
from triton_interpreter import load_kernel_module, require_interpreter

require_interpreter()

from ninfer.kernels import dispatch  # noqa: E402 (after the interpreter is switched on)
from ninfer.models.layers import attention  # noqa: E402


def test_model_logits_are_the_bits_of_the_unfused_kernels(monkeypatch, tmp_path):
    monkeypatch.setattr(dispatch, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(dispatch, "HAS_FLA", False)  # fla's prefill does not run here
    artifact = convert_to_artifact(make_hf_model("dense_whole_groups"), tmp_path)
    model = load_ours(artifact, torch.float16)

    def run() -> list[torch.Tensor]:
        runner = Runner(model)
        runner.add("a")
        with torch.inference_mode():
            return [runner.step({"a": ids})["a"] for ids in ([3, 17, 40, 5], [8, 2], [9], [21])]

    fused = run()
    unfused_prelude = composed_prelude(
        *(
            load_kernel_module(name)
            for name in ("rms_norm_triton", "rotary_triton", "kv_write_triton")
        )
    )
    monkeypatch.setattr(attention, "attention_prelude", unfused_prelude)
    unfused = run()
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused, strict=True))
