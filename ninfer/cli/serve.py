"""`ninfer serve [MODEL]`: the HTTP server (OpenAI Chat Completions and Responses, Anthropic
Messages). The server stack is imported inside `run`, so other commands never load it."""

from __future__ import annotations

import argparse
import sys

from ninfer.cli.config import add_config_argument, settings_from
from ninfer.serve.settings import ServeSettings

SETTINGS = ServeSettings


def _flag(parser, name: str, kind, help_text: str, metavar: str | None = None) -> None:
    parser.add_argument(name, type=kind, default=None, metavar=metavar, help=help_text)


def _switch(parser, name: str, help_text: str) -> None:
    parser.add_argument(name, action="store_true", default=None, help=help_text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServeSettings()
    parser.add_argument(
        "model", nargs="?", default=None, help=".ninfer artifact (default: the shipped model)"
    )
    add_config_argument(parser)
    net = parser.add_argument_group("network")
    _flag(net, "--host", str, f"listen address (default {d.host}: this machine only)")
    _flag(net, "--port", int, f"listen port (default {d.port})")
    _flag(net, "--api-key", str, "require this key as 'Authorization: Bearer' or 'x-api-key'")
    _flag(net, "--api-key-file", str, "read the API key from a file", "FILE")
    _switch(net, "--cors", "allow cross-origin browser requests")
    _flag(net, "--max-request-mib", int, f"request body limit (default {d.max_request_mib})", "N")
    model = parser.add_argument_group("model and limits")
    _flag(model, "--model-id", str, "public model name (default: the artifact file name)")
    _flag(
        model,
        "--max-context",
        int,
        f"prompt + output tokens per request (default {d.max_context})",
        "N",
    )
    _flag(
        model,
        "--kv-capacity",
        str,
        "attention K/V tokens shared by all requests, or auto (default auto)",
        "N|auto",
    )
    _flag(
        model,
        "--prefill-chunk",
        int,
        f"prompt tokens per step while some request decodes (default {d.prefill_chunk})",
        "N",
    )
    _flag(
        model,
        "--idle-prefill-chunk",
        int,
        "prompt tokens per step while nothing decodes (default 4 x --prefill-chunk)",
        "N",
    )
    _flag(
        model,
        "--max-concurrency",
        int,
        f"requests generating at once (default {d.max_concurrency})",
        "N",
    )
    _flag(
        model,
        "--max-pending-requests",
        int,
        f"requests waiting for a lane (default {d.max_pending_requests})",
        "N",
    )
    _flag(
        model,
        "--pending-timeout-ms",
        int,
        f"longest wait for a lane (default {d.pending_timeout_ms})",
        "MS",
    )
    _flag(
        model,
        "--default-max-tokens",
        int,
        f"output limit of a request that sets none (default {d.default_max_tokens})",
        "N",
    )
    _flag(model, "--device", str, "torch device (default: cuda when present, else cpu)")
    _flag(model, "--dtype", str, "weights and activations: bfloat16, float16 or float32")
    _flag(
        model,
        "--gdn-state-dtype",
        str,
        "the GDN recurrent state per request: float32 (default) or bfloat16 (half its memory "
        "and decode traffic, rounded each step)",
    )
    _flag(
        model,
        "--tensor-parallel",
        int,
        "split the model over N processes, one GPU each (default 1; docs/parallel.md)",
        "N",
    )
    _switch(
        model, "--expert-parallel", "MoE: split the experts whole over the tensor-parallel ranks"
    )
    _switch(model, "--no-cuda-graph", "run decode steps eagerly instead of from CUDA graphs")
    _switch(
        model,
        "--no-overlap",
        "read each decode step back before launching the next (debugging, comparison)",
    )
    prompt = parser.add_argument_group("prompt defaults")
    _switch(prompt, "--no-thinking", "requests that do not ask for thinking get none")
    _switch(prompt, "--preserve-thinking", "keep reasoning of earlier turns in the prompt")
    sampling = parser.add_argument_group("sampling (over the model's presets; requests win)")
    _flag(sampling, "--temperature", float, "in [0, 2]")
    _flag(sampling, "--top-p", float, "in [0, 1]")
    _flag(sampling, "--top-k", int, "0 disables")
    _flag(sampling, "--min-p", float, "in [0, 1]")
    _flag(sampling, "--presence-penalty", float, "in [-2, 2]")
    _flag(sampling, "--frequency-penalty", float, "in [-2, 2]")
    _flag(sampling, "--seed", int, "seed of requests that set none (default: random per request)")
    _switch(sampling, "--greedy", "always pick the most likely token")
    state = parser.add_argument_group("responses store and logs")
    _flag(
        state,
        "--response-store-max-records",
        int,
        f"stored Responses (default {d.response_store_max_records})",
        "N",
    )
    _flag(
        state,
        "--response-store-max-mib",
        int,
        f"stored Responses size (default {d.response_store_max_mib})",
        "N",
    )
    _flag(
        state,
        "--request-log-jsonl",
        str,
        "append one JSON line per request event (never text)",
        "FILE",
    )
    _flag(
        state,
        "--log-stats-interval-ms",
        int,
        f"throughput line period, 0 = off (default {d.log_stats_interval_ms})",
        "MS",
    )


def run(args: argparse.Namespace) -> int:
    settings = settings_from(ServeSettings, args, "serve")
    from ninfer.serve.server import serve

    return serve(settings, sys.argv)
