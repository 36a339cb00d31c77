"""The batch sampler: each knob alone, on logits built in the test."""

from __future__ import annotations

import math

import pytest
import torch

from ninfer.engine.request import SamplingParams
from ninfer.engine.sampler import Sampler, SampleRow, uniform_noise

VOCAB = 50


def make_sampler(lanes: int = 4) -> Sampler:
    return Sampler(VOCAB, lanes, "cpu")


def rows(params: SamplingParams, n: int, *, seed0: int = 0, step: int = 0) -> list[SampleRow]:
    return [SampleRow(params, seed=seed0 + i, step=step, lane=0) for i in range(n)]


def sample_many(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    """Token ids sampled for one distribution under n different seeds, in a single batch."""
    logits = logits_row.expand(n, -1).contiguous()
    return make_sampler(1).sample(logits, rows(params, n)).token_ids


def test_greedy_picks_argmax_of_each_row():
    logits = torch.randn(6, VOCAB)
    out = make_sampler().sample(logits, rows(SamplingParams.greedy(), 6))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_temperature_sampling_follows_softmax():
    torch.manual_seed(0)
    logits = torch.randn(VOCAB) * 2
    temperature = 0.7
    ids = sample_many(logits, SamplingParams(temperature=temperature))
    freq = torch.bincount(ids, minlength=VOCAB).float() / ids.numel()
    expected = torch.softmax(logits / temperature, -1)
    assert (freq - expected).abs().max().item() < 0.03


def test_low_temperature_concentrates_on_argmax():
    logits = torch.randn(VOCAB)
    ids = sample_many(logits, SamplingParams(temperature=0.01), n=500)
    assert set(ids.tolist()) == {int(logits.argmax())}


def test_top_k_keeps_only_the_k_best():
    logits = torch.randn(VOCAB)
    ids = sample_many(logits, SamplingParams(temperature=5.0, top_k=3))
    assert set(ids.tolist()) == set(torch.topk(logits, 3).indices.tolist())


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0] + [-5.0] * (VOCAB - 4))
    probs = torch.softmax(logits, -1)
    # the two best hold less than 0.8 of the mass, the three best more
    assert probs[:2].sum() < 0.8 < probs[:3].sum()
    ids = sample_many(logits, SamplingParams(top_p=0.8))
    assert set(ids.tolist()) == {0, 1, 2}


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    logits = torch.tensor([2.0, 1.5, 0.0] + [-3.0] * (VOCAB - 3))
    probs = torch.softmax(logits, -1)
    min_p = 0.5
    ids = sample_many(logits, SamplingParams(min_p=min_p))
    allowed = set((probs >= min_p * probs.max()).nonzero().flatten().tolist())
    assert set(ids.tolist()) == allowed == {0, 1}


def test_logit_bias_can_force_and_ban_tokens():
    logits = torch.randn(2, VOCAB)
    best = logits.argmax(-1).tolist()
    forced = SamplingParams.greedy(logit_bias={7: 100.0})
    banned = SamplingParams.greedy(logit_bias={best[1]: -100.0})
    sampler = make_sampler()
    out = sampler.sample(logits, [SampleRow(forced, 0, 0, 0), SampleRow(banned, 0, 0, 1)])
    assert out.token_ids[0].item() == 7
    assert out.token_ids[1].item() == logits[1].topk(2).indices[1].item()


def test_frequency_penalty_grows_with_each_repeat():
    sampler = make_sampler()
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1.0
    logits[0, 4] = 0.5
    params = SamplingParams.greedy(frequency_penalty=0.3)
    picked = [
        sampler.sample(logits, [SampleRow(params, 0, s, 0)]).token_ids.item() for s in range(4)
    ]
    # 3 wins until it has been generated twice (1.0 - 2 * 0.3 < 0.5)
    assert picked == [3, 3, 4, 3]


def test_presence_penalty_is_flat_after_the_first_use():
    sampler = make_sampler()
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1.0
    logits[0, 4] = 0.5
    params = SamplingParams.greedy(presence_penalty=0.6)
    picked = [
        sampler.sample(logits, [SampleRow(params, 0, s, 0)]).token_ids.item() for s in range(4)
    ]
    # after one use each token pays 0.6 however often it repeats: 3 (0.4) beats 4 (-0.1)
    assert picked == [3, 4, 3, 3]


def test_penalties_count_per_lane_and_reset_on_reuse():
    sampler = make_sampler()
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1.0
    penalised = SamplingParams.greedy(presence_penalty=2.0)
    sampler.sample(logits, [SampleRow(penalised, 0, 0, lane=1)])
    assert sampler.sample(logits, [SampleRow(penalised, 0, 1, lane=2)]).token_ids.item() == 3
    assert sampler.sample(logits, [SampleRow(penalised, 0, 1, lane=1)]).token_ids.item() != 3
    sampler.reset_lane(1)
    assert sampler.sample(logits, [SampleRow(penalised, 0, 0, lane=1)]).token_ids.item() == 3


def test_same_seed_same_token_whatever_shares_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(5, VOCAB)
    params = SamplingParams(temperature=1.5)
    alone = make_sampler().sample(logits[2:3], [SampleRow(params, 1234, 9, 0)]).token_ids
    batch = [SampleRow(params, seed, 9, 0) for seed in (5, 6, 1234, 7, 8)]
    together = make_sampler().sample(logits, batch).token_ids
    assert together[2].item() == alone.item()


def test_different_seeds_give_different_sequences():
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams()

    def sequence(seed: int) -> list[int]:
        sampler = make_sampler()
        return [
            sampler.sample(logits, [SampleRow(params, seed, s, 0)]).token_ids.item()
            for s in range(16)
        ]

    assert sequence(42) == sequence(42)
    assert sequence(42) != sequence(43)


def test_noise_is_uniform_and_open_interval():
    keys = torch.tensor([1, 2, 3])
    ids = torch.arange(20000).expand(3, -1)
    u = uniform_noise(keys, ids)
    assert 0.0 < u.min().item() and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])


def test_logprobs_are_model_log_softmax_with_sorted_top_n():
    logits = torch.randn(3, VOCAB)
    params = SamplingParams.greedy(logprobs=4)
    out = make_sampler().sample(logits, rows(params, 3))
    expected = torch.log_softmax(logits, -1)
    chosen = out.token_ids
    torch.testing.assert_close(out.logprobs, expected.gather(1, chosen[:, None]).squeeze(1))
    assert out.top_ids.shape == (3, 4)
    torch.testing.assert_close(out.top_logprobs, expected.topk(4).values)


def test_mixed_batch_keeps_each_rows_knobs():
    logits = torch.randn(3, VOCAB)
    batch = [
        SampleRow(SamplingParams.greedy(), 0, 0, 0),
        SampleRow(SamplingParams(top_k=1, temperature=3.0), 1, 0, 1),
        SampleRow(SamplingParams(temperature=1.0, top_k=2), 2, 0, 2),
    ]
    out = make_sampler().sample(logits, batch).token_ids.tolist()
    assert out[0] == logits[0].argmax().item()
    assert out[1] == logits[1].argmax().item()
    assert out[2] in logits[2].topk(2).indices.tolist()


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -1),
        ("min_p", 1.5),
        ("logprobs", 21),
        ("presence_penalty", math.inf),
        ("max_tokens", 0),
    ],
)
def test_out_of_range_parameters_are_rejected(field, value):
    from ninfer.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value}).validate()
