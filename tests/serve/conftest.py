"""Fixtures of the server tests: the tiny Qwen-style chat frontend, a scripted engine and a
client factory over a fresh app."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from serve_helpers import EFFORTS, ScriptedEngine, model_info

from ninfer.chat import ChatFrontend
from ninfer.chat.qwen_style import tiny_frontend_resources
from ninfer.serve.app import ServerState, create_app
from ninfer.serve.request import ModelInfo
from ninfer.serve.request_log import RequestLog
from ninfer.serve.response_store import ResponseStore
from ninfer.serve.service import GenerationService


@pytest.fixture(scope="session")
def frontend() -> ChatFrontend:
    return ChatFrontend(*tiny_frontend_resources())


@pytest.fixture(scope="session")
def effort_frontend() -> ChatFrontend:
    return ChatFrontend(*tiny_frontend_resources(efforts=EFFORTS))


@pytest.fixture
def info(frontend) -> ModelInfo:
    return model_info(frontend)


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def make_client(frontend, engine, tmp_path):
    """make_client(**ServerState overrides) -> TestClient over a fresh app on `engine`."""
    clients = []

    def build(*, chat_frontend=None, info_overrides=None, max_context=4096, **state) -> TestClient:
        used = chat_frontend or frontend
        service = GenerationService(engine, used, max_context=max_context)
        state.setdefault("log", RequestLog(tmp_path / "requests.jsonl"))
        state.setdefault("store", ResponseStore())
        server = ServerState(
            service=service, info=model_info(used, **(info_overrides or {})), **state
        )
        client = TestClient(create_app(server))
        client.server_state = server
        clients.append(client)
        return client

    yield build
    for client in clients:
        client.close()
