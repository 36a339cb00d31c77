"""The output gate in the decode attention's merge kernel, in a whole model under Triton's CPU
interpreter, every kernel dispatched to its Triton form, in fp16 as the engine runs: decode
steps give the same logits, bit for bit, as the attention followed by the output-gate kernel."""

from __future__ import annotations

import torch
from tiny_qwen import Runner, convert_to_artifact, load_ours, make_hf_model
from triton_interpreter import require_interpreter

require_interpreter()

from ninfer.kernels import dispatch  # noqa: E402 (after the interpreter is switched on)
from ninfer.models.layers import attention  # noqa: E402


def test_model_logits_are_the_bits_of_the_separate_gate(monkeypatch, tmp_path):
    monkeypatch.setattr(dispatch, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(dispatch, "HAS_FLA", False)  # fla's prefill does not run here
    artifact = convert_to_artifact(make_hf_model("dense_whole_groups"), tmp_path)
    model = load_ours(artifact, torch.float16)
    calls = []

    def run() -> list[torch.Tensor]:
        runner = Runner(model)
        runner.add("a")
        with torch.inference_mode():
            return [runner.step({"a": ids})["a"] for ids in ([3, 17, 40, 5], [8], [9], [21])]

    def counted(*args):
        calls.append(1)
        return dispatch.paged_attention_decode_gated(*args)

    monkeypatch.setattr(attention, "paged_attention_decode_gated", counted)
    fused = run()
    assert calls  # the decode steps took the gated merge

    def separate(q, k_cache, v_cache, page_table, seq_lens, scale, gate, split, max_seq_len):
        out = dispatch.paged_attention_decode(
            q, k_cache, v_cache, page_table, seq_lens, scale, max_seq_len
        )
        return dispatch.sigmoid_gate(out, gate, split)

    monkeypatch.setattr(attention, "paged_attention_decode_gated", separate)
    unfused = run()
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused, strict=True))
