from ninfer.chat import SamplingFields, resolve_sampling, sampling_preset

QWEN_GENERATION_CONFIG = {
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "eos_token_id": [1, 2],
}


def test_preset_reads_generation_config_fields():
    preset = sampling_preset(QWEN_GENERATION_CONFIG, thinking=True)

    assert preset == SamplingFields(temperature=0.6, top_p=0.95, top_k=20)


def test_do_sample_false_makes_the_preset_greedy():
    preset = sampling_preset({"do_sample": False, "temperature": 0.7}, thinking=True)

    assert preset.temperature == 0.0


def test_mode_presets_override_top_level_fields_per_thinking_mode():
    config = {
        **QWEN_GENERATION_CONFIG,
        "ninfer_sampling_presets": {
            "thinking": {"temperature": 1.0, "presence_penalty": 0.0},
            "non_thinking": {"temperature": 0.7, "top_p": 0.8, "presence_penalty": 1.5},
        },
    }

    thinking = sampling_preset(config, thinking=True)
    plain = sampling_preset(config, thinking=False)

    assert (thinking.temperature, thinking.top_p, thinking.presence_penalty) == (1.0, 0.95, 0.0)
    assert (plain.temperature, plain.top_p, plain.presence_penalty) == (0.7, 0.8, 1.5)
    assert thinking.top_k == plain.top_k == 20


def test_request_fields_beat_flags_beat_preset():
    preset = SamplingFields(temperature=0.6, top_p=0.95, top_k=20)
    flags = SamplingFields(temperature=0.9, top_k=10, seed=7)
    request = SamplingFields(temperature=0.3)

    resolved = resolve_sampling(preset, flags, request)

    assert resolved == SamplingFields(
        temperature=0.3,
        top_p=0.95,
        top_k=10,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seed=7,
    )


def test_omitted_request_fields_do_not_override_the_preset():
    resolved = resolve_sampling(SamplingFields(temperature=0.6, top_k=20), None, SamplingFields())

    assert (resolved.temperature, resolved.top_k) == (0.6, 20)


def test_greedy_wins_over_every_level():
    resolved = resolve_sampling(
        SamplingFields(temperature=0.6), SamplingFields(), SamplingFields(temperature=1.5), True
    )

    assert resolved.temperature == 0.0


def test_empty_generation_config_gives_neutral_sampling():
    resolved = resolve_sampling(sampling_preset(None, thinking=False))

    assert (resolved.temperature, resolved.top_p, resolved.top_k, resolved.min_p) == (1, 1, 0, 0)
    assert resolved.seed is None
