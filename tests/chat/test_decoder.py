import pytest

from ninfer.chat import IncrementalDetokenizer, OutputDecoder


def run(decoder: OutputDecoder, ids: list[int]) -> tuple[str, str, list]:
    """Feeds ids as the engine would (stopping at the first stopped step, else finishing);
    returns (reasoning, content, every step)."""
    steps = []
    for token_id in ids:
        steps.append(decoder.push(token_id))
        if steps[-1].stopped:
            break
    else:
        steps.append(decoder.finish())
    return "".join(s.reasoning for s in steps), "".join(s.content for s in steps), steps


MULTIBYTE = "Hi 你好, 🦀 crab ünïcödé ✓ 𝔘 done"


def test_multibyte_text_streams_intact(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    detok = IncrementalDetokenizer(tokenizer)

    deltas = [detok.push(i) for i in ids] + [detok.flush()]

    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "no token splits a character"
    assert "".join(deltas) == MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_text_streams_intact_through_the_output_decoder(tokenizer):
    ids = tokenizer.encode(f"<think>\n{MULTIBYTE}\n</think>\n\n{MULTIBYTE}")

    reasoning, content, steps = run(OutputDecoder(tokenizer), ids)

    assert reasoning == MULTIBYTE and content == MULTIBYTE
    assert not any("\ufffd" in s.reasoning + s.content for s in steps)


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("ok 🦀")
    detok = IncrementalDetokenizer(tokenizer)

    text = "".join(detok.push(i) for i in ids[:-1]) + detok.flush()

    assert text == "ok \ufffd"


def test_stop_string_split_across_tokens_stops_at_the_right_character(tokenizer):
    text = "The weather in Paris is sunny today, and tomorrow it will rain."
    stop = "is sunny"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces), "the stop must span tokens"

    decoder = OutputDecoder(tokenizer, stop=[stop])
    _, content, steps = run(decoder, ids)

    assert content == "The weather in Paris "
    assert steps[-1].stopped and steps[-1].stop == stop
    # stopped on exactly the token that completes the stop
    assert stop in tokenizer.decode(ids[: len(steps)])
    assert stop not in tokenizer.decode(ids[: len(steps) - 1])


def test_stop_text_and_everything_after_it_in_the_token_is_withheld(tokenizer):
    ids = tokenizer.encode("abc, def")

    _, content, steps = run(OutputDecoder(tokenizer, stop=["c"]), ids)

    assert content == "ab"
    assert steps[-1].stop == "c"


def test_partial_stop_is_released_when_it_does_not_complete(tokenizer):
    ids = tokenizer.encode("Paris is nice")

    _, content, steps = run(OutputDecoder(tokenizer, stop=["is sunny"]), ids)

    assert content == "Paris is nice"
    assert not any(s.stopped for s in steps)


def test_earliest_of_several_stops_wins(tokenizer):
    ids = tokenizer.encode("one two three")

    _, content, steps = run(OutputDecoder(tokenizer, stop=["three", "two"]), ids)

    assert content == "one "
    assert steps[-1].stop == "two"


def test_reasoning_stop_applies_to_the_reasoning_channel_only(tokenizer):
    ids = tokenizer.encode("I think rain.\n</think>\n\nrain tomorrow")

    content_stop = run(OutputDecoder(tokenizer, True, stop=["rain"]), ids)
    reasoning_stop = run(OutputDecoder(tokenizer, True, reasoning_stop=["rain"]), ids)

    assert content_stop[:2] == ("I think rain.", "")
    assert content_stop[2][-1].stop == "rain"
    assert reasoning_stop[:2] == ("I think ", "")
    assert reasoning_stop[2][-1].stop == "rain"


def test_think_block_splits_reasoning_from_content(tokenizer):
    ids = tokenizer.encode("\nThe user wants the weather.\n</think>\n\nIt is sunny.")
    decoder = OutputDecoder(tokenizer, starts_in_reasoning=True)

    reasoning, content, _ = run(decoder, ids)

    assert reasoning == "The user wants the weather."
    assert content == "It is sunny."
    close = ids.index(tokenizer.token_to_id("</think>"))
    assert decoder.reasoning_tokens == close + 1
    assert decoder.num_tokens == len(ids)


def test_output_may_open_its_own_think_block_at_the_start(tokenizer):
    ids = tokenizer.encode("<think>\nhmm\n</think>\n\nanswer <think> stays")

    reasoning, content, _ = run(OutputDecoder(tokenizer, starts_in_reasoning=False), ids)

    assert (reasoning, content) == ("hmm", "answer <think> stays")


def test_content_without_thinking_passes_through(tokenizer):
    text = "Plain answer with trailing space "
    reasoning, content, _ = run(OutputDecoder(tokenizer), tokenizer.encode(text))

    assert (reasoning, content) == ("", text)


def test_unclosed_reasoning_is_flushed_at_finish(tokenizer):
    ids = tokenizer.encode("still thinking </thi")
    decoder = OutputDecoder(tokenizer, starts_in_reasoning=True)

    reasoning, content, _ = run(decoder, ids)

    assert (reasoning, content) == ("still thinking </thi", "")
    assert decoder.reasoning_tokens == len(ids)


def test_stop_token_id_ends_output_without_text(tokenizer):
    eos = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("Paris is") + [eos] + tokenizer.encode("more")
    decoder = OutputDecoder(tokenizer, stop=["is sunny"], stop_token_ids=[eos])

    _, content, steps = run(decoder, ids)

    assert content == "Paris is"  # the held partial stop is released
    assert steps[-1].stopped and steps[-1].stop == eos
    assert decoder.num_tokens == len(tokenizer.encode("Paris is")) + 1


def test_hidden_special_tokens_produce_no_text(tokenizer):
    ids = [tokenizer.token_to_id("<|endoftext|>")] + tokenizer.encode("hi")

    assert run(OutputDecoder(tokenizer), ids)[1] == "hi"


def test_push_after_stop_is_an_error(tokenizer):
    decoder = OutputDecoder(tokenizer, stop_token_ids=[0])
    decoder.push(0)

    with pytest.raises(RuntimeError):
        decoder.push(1)
    assert decoder.finish().content == ""


def test_raw_output_keeps_think_markers_in_content(tokenizer):
    text = "\nhmm\n</think>\n\nanswer"

    decoder = OutputDecoder(tokenizer, starts_in_reasoning=True, split_reasoning=False)
    reasoning, content, _ = run(decoder, tokenizer.encode(text))

    assert (reasoning, content) == ("", text)
    assert decoder.reasoning_tokens == 0
