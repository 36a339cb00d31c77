import json

import pytest

from ninfer.chat import ChatFrontend, Tokenizer
from ninfer.chat.decoder import ThinkSplitter


def test_encode_adds_no_specials_and_decode_round_trips(tokenizer):
    text = "<|im_start|>user\nCafé 你好 🦀<|im_end|>\n"
    ids = tokenizer.encode(text)

    assert ids[0] == tokenizer.token_to_id("<|im_start|>")
    assert tokenizer.decode(ids, skip_hidden=False) == text
    assert tokenizer.decode(ids) == "user\nCafé 你好 🦀\n"


def test_markup_tokens_are_never_hidden_even_when_marked_special(resources):
    tokenizer_json, config, _, generation = resources
    data = json.loads(tokenizer_json)
    for token in data["added_tokens"]:
        token["special"] = True
    tokenizer = Tokenizer(json.dumps(data), config, generation)

    ids = tokenizer.encode("<|im_end|><think>x</think><tool_call>")

    assert tokenizer.decode(ids) == "<think>x</think><tool_call>"


def test_eos_ids_come_from_generation_config_else_tokenizer_config(resources):
    tokenizer_json, config, _, generation = resources
    with_generation = Tokenizer(tokenizer_json, config, {"eos_token_id": 5})
    without = Tokenizer(tokenizer_json, config, None)

    assert with_generation.eos_token_ids == (5,)
    assert without.eos_token_ids == (without.token_to_id("<|im_end|>"),)
    assert Tokenizer(tokenizer_json, config, generation).eos_token_ids == tuple(
        generation["eos_token_id"]
    )


class FakeArtifact:
    def __init__(self, resources: dict[str, bytes]):
        self._resources = resources

    def resource(self, role: str, component: str = "text") -> bytes | None:
        return self._resources.get(role) if component == "text" else None


def test_frontend_from_artifact_resources(resources):
    tokenizer_json, config, template, generation = resources
    artifact = FakeArtifact(
        {
            "tokenizer": tokenizer_json.encode(),
            "tokenizer_config": json.dumps(config).encode(),
            "chat_template": template.encode(),
            "generation_config": json.dumps(generation).encode(),
        }
    )

    frontend = ChatFrontend.from_artifact(artifact)
    prompt = frontend.render([{"role": "user", "content": "hi"}])

    assert prompt.text.endswith("<|im_start|>assistant\n<think>\n")
    assert frontend.stop_token_ids == tuple(generation["eos_token_id"])
    assert frontend.sampling_preset(thinking=True).temperature == generation["temperature"]


def test_frontend_from_directory(tmp_path, resources):
    tokenizer_json, config, template, generation = resources
    (tmp_path / "tokenizer.json").write_text(tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(template)

    frontend = ChatFrontend.from_directory(tmp_path)

    assert frontend.has_template
    assert frontend.stop_token_ids == (frontend.tokenizer.token_to_id("<|im_end|>"),)


def test_frontend_without_template_cannot_render(resources):
    frontend = ChatFrontend(resources[0])

    assert not frontend.has_template
    with pytest.raises(Exception, match="no chat template"):
        frontend.render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "text, starts_in_reasoning, expected",
    [
        ("\nfirst  \n</think>\n\n answer \n", True, ("first", "answer \n")),
        ("  <think>\nr\n</think>\n\nc", False, ("r", "c")),
        ("<thinking is fun", False, ("", "<thinking is fun")),
        ("a </thin b</think>c", True, ("a </thin b", "c")),
        ("   ", True, ("", "")),
    ],
)
def test_think_split_is_the_same_for_any_chunking(text, starts_in_reasoning, expected):
    for chunk in (1, 2, 5, len(text)):
        splitter = ThinkSplitter(starts_in_reasoning)
        segments = []
        for i in range(0, len(text), chunk):
            segments += splitter.feed(text[i : i + chunk])
        segments += splitter.finish()
        reasoning = "".join(t for c, t in segments if c == "reasoning")
        content = "".join(t for c, t in segments if c == "content")
        assert (reasoning, content) == expected, f"chunk={chunk}"
