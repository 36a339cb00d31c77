"""Our Qwen3.5 dense and MoE models give transformers' logits, however the tokens are batched:
whole prefill, prefill in random chunks, prefill then single-token decodes, and several
sequences decoded together. Our model is loaded from an fp32 artifact made by our converter.

Error = max |ours - reference| / max |reference| over all compared logits.
- fp32 (<= 1e-4): the reference is transformers over the whole sequence at once, so chunking,
  paging and decoding must reproduce the single-pass result.
- bf16 (<= 2e-2): the reference is transformers in bf16 fed the same pieces through its own
  cache. bf16 rounding depends on how the work is split, and random models amplify a one-ulp
  difference, so only the same schedule is a fair bf16 comparison.
"""

import random

import pytest
import torch
from tiny_qwen import (
    TINY_CONFIGS,
    VOCAB,
    Runner,
    convert_to_artifact,
    hf_in_dtype,
    hf_logits_in_steps,
    load_ours,
    make_hf_model,
    rel_err,
)

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
CONFIGS = pytest.mark.parametrize("name", list(TINY_CONFIGS))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(name, dtype) -> (transformers in dtype, ours loaded from our fp32 artifact in dtype)."""
    built: dict = {}

    def get(name: str, dtype: torch.dtype):
        if name not in built:
            hf = make_hf_model(name)
            built[name] = (hf, convert_to_artifact(hf, tmp_path_factory.mktemp(name)))
        hf, artifact = built[name]
        return hf_in_dtype(hf, dtype), load_ours(artifact, dtype)

    return get


def reference(hf, token_ids: list[int], steps: list[int], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        steps = [len(token_ids)]
    return hf_logits_in_steps(hf, token_ids, steps)


def tokens(count: int, seed: int) -> list[int]:
    gen = random.Random(seed)
    return [gen.randrange(VOCAB) for _ in range(count)]


@CONFIGS
@DTYPES
def test_whole_prompt_prefill_matches_transformers(models, name, dtype):
    hf, ours = models(name, dtype)
    prompt = tokens(150, seed=1)  # crosses two 64-token pages and two GDN chunks
    runner = Runner(ours)
    runner.add("a")
    logits = runner.step({"a": prompt})["a"]
    assert rel_err(logits, reference(hf, prompt, [150], dtype)) <= TOLERANCE[dtype]


@CONFIGS
@DTYPES
def test_prefill_in_random_chunks_matches_transformers(models, name, dtype):
    hf, ours = models(name, dtype)
    prompt = tokens(150, seed=2)
    gen = random.Random(3)
    steps: list[int] = []
    while sum(steps) < len(prompt):
        steps.append(min(gen.choice([1, 2, 3, 7, 30, 64, 70]), len(prompt) - sum(steps)))
    runner = Runner(ours)
    runner.add("a")
    pieces, start = [], 0
    for size in steps:
        pieces.append(runner.step({"a": prompt[start : start + size]})["a"])
        start += size
    assert rel_err(torch.cat(pieces), reference(hf, prompt, steps, dtype)) <= TOLERANCE[dtype]


@CONFIGS
@DTYPES
def test_prefill_then_16_decodes_match_transformers(models, name, dtype):
    hf, ours = models(name, dtype)
    sequence = tokens(76, seed=4)  # 60 prompt tokens; the decodes cross a page boundary
    runner = Runner(ours)
    runner.add("a")
    pieces = [runner.step({"a": sequence[:60]})["a"]]
    for token in sequence[60:]:
        pieces.append(runner.step({"a": [token]})["a"])
    expected = reference(hf, sequence, [60] + [1] * 16, dtype)
    assert rel_err(torch.cat(pieces), expected) <= TOLERANCE[dtype]


@CONFIGS
@DTYPES
def test_three_sequences_decoded_in_one_batch_match_transformers(models, name, dtype):
    hf, ours = models(name, dtype)
    lengths = {"a": 70, "b": 5, "c": 129}
    decodes = 4
    sequences = {s: tokens(n + decodes, seed=10 + i) for i, (s, n) in enumerate(lengths.items())}
    runner = Runner(ours)
    for seq in sequences:
        runner.add(seq)
    # one varlen prefill of all three, then every decode step batches all three
    prefill = runner.step({s: sequences[s][:n] for s, n in lengths.items()})
    pieces = {s: [prefill[s]] for s in sequences}
    for step in range(decodes):
        out = runner.step({s: [sequences[s][n + step]] for s, n in lengths.items()})
        for seq in sequences:
            pieces[seq].append(out[seq])
    for seq, sequence in sequences.items():
        expected = reference(hf, sequence, [lengths[seq]] + [1] * decodes, dtype)
        assert rel_err(torch.cat(pieces[seq]), expected) <= TOLERANCE[dtype], seq
