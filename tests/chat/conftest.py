"""Fixtures of the chat tests: a tiny byte-level BPE tokenizer with the Qwen special tokens and
the Qwen-style template, as a `ChatFrontend` and (for reference checks) a transformers
tokenizer over the same tokenizer.json."""

import pytest

from ninfer.chat import ChatFrontend
from ninfer.chat.qwen_style import tiny_frontend_resources

EFFORTS = ("low", "medium", "xhigh")


@pytest.fixture(scope="session")
def resources():
    return tiny_frontend_resources()


@pytest.fixture(scope="session")
def frontend(resources) -> ChatFrontend:
    return ChatFrontend(*resources)


@pytest.fixture(scope="session")
def effort_frontend() -> ChatFrontend:
    return ChatFrontend(*tiny_frontend_resources(efforts=EFFORTS))


@pytest.fixture(scope="session")
def tokenizer(frontend):
    return frontend.tokenizer


@pytest.fixture(scope="session")
def hf_tokenizer(resources):
    """transformers' tokenizer over the same files; apply_chat_template is the reference."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RawTokenizer

    tokenizer_json, config, _, _ = resources
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=RawTokenizer.from_str(tokenizer_json),
        eos_token=config["eos_token"],
        pad_token=config["pad_token"],
    )
