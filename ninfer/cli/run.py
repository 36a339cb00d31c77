"""`ninfer run [MODEL]`: one request. The answer streams to stdout; reasoning, load progress and
the timing report go to stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ninfer.cli.config import add_config_argument, settings_from
from ninfer.engine.config import GDN_STATE_DTYPES
from ninfer.errors import ConfigError, NinferError


def _token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ids: {text!r}") from None


@dataclass(slots=True)
class RunSettings:
    """Settings of `ninfer run` (flags or `--config` keys) with their defaults."""

    model: str | None = None
    max_context: int = 2048
    kv_capacity: str | None = None  # tokens or "auto"; default: max_context
    prefill_chunk: int = 1024
    idle_prefill_chunk: int | None = None  # None: 4 x prefill_chunk
    max_tokens: int = 128
    device: str | None = None
    dtype: str | None = None
    gdn_state_dtype: str = "float32"
    tensor_parallel: int = 1
    expert_parallel: bool = False
    no_cuda_graph: bool = False
    no_overlap: bool = False
    greedy: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    reasoning_stop: list[str] = field(default_factory=list)
    stop_token_id: list[int] = field(default_factory=list)
    no_thinking: bool = False
    reasoning_effort: str | None = None
    raw_output: bool = False
    print_token_ids: bool = False


SETTINGS = RunSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RunSettings()
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=".ninfer file (default: the shipped model)",
    )
    add_config_argument(parser)
    source = parser.add_argument_group("input (exactly one)")
    inputs = source.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--prompt", help="user message, rendered with the chat template")
    inputs.add_argument(
        "--messages", metavar="FILE", help="JSON list of messages, or {messages, tools}"
    )
    inputs.add_argument(
        "--prompt-ids", type=_token_ids, metavar="1,2,3", help="raw prompt token ids (no template)"
    )

    context = parser.add_argument_group("context")
    context.add_argument(
        "--max-context",
        type=int,
        metavar="N",
        help=f"prompt + output ceiling (default {d.max_context})",
    )
    context.add_argument(
        "--kv-capacity", metavar="N|auto", help="K/V pool in tokens or auto (default: max-context)"
    )
    context.add_argument(
        "--prefill-chunk",
        type=int,
        metavar="N",
        help=f"prompt tokens per step while some request decodes (default {d.prefill_chunk})",
    )
    context.add_argument(
        "--idle-prefill-chunk",
        type=int,
        metavar="N",
        help="prompt tokens per step while nothing decodes (default 4 x --prefill-chunk)",
    )
    context.add_argument(
        "--max-tokens",
        "--max-new",
        dest="max_tokens",
        type=int,
        metavar="N",
        help=f"output limit (default {d.max_tokens})",
    )

    device = parser.add_argument_group("device")
    device.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    device.add_argument(
        "--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on cuda, float32 on cpu"
    )
    device.add_argument(
        "--gdn-state-dtype",
        choices=GDN_STATE_DTYPES,
        help="the GDN recurrent state: float32 (default) or bfloat16 (half its memory and "
        "decode traffic, rounded each step)",
    )
    device.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="N",
        help="split the model over N processes, one GPU each (default 1; docs/parallel.md)",
    )
    device.add_argument(
        "--expert-parallel",
        action="store_true",
        default=None,
        help="MoE: split the experts whole over the tensor-parallel ranks",
    )
    device.add_argument(
        "--no-cuda-graph",
        action="store_true",
        default=None,
        help="run decode steps eagerly instead of from CUDA graphs (debugging)",
    )
    device.add_argument(
        "--no-overlap",
        action="store_true",
        default=None,
        help="read each decode step back before launching the next (debugging, comparison)",
    )

    sampling = parser.add_argument_group("sampling (override the model's preset)")
    sampling.add_argument(
        "--greedy", action="store_true", default=None, help="argmax decoding (applied last)"
    )
    sampling.add_argument("--temperature", type=float, help=">= 0; 0 picks the likeliest token")
    sampling.add_argument("--top-p", type=float, help="nucleus mass, in (0, 1]")
    sampling.add_argument("--top-k", type=int, help="keep the k likeliest tokens; 0 disables")
    sampling.add_argument("--min-p", type=float, help="in [0, 1], relative to the likeliest token")
    sampling.add_argument("--presence-penalty", type=float, help="in [-2, 2]")
    sampling.add_argument("--frequency-penalty", type=float, help="in [-2, 2]")
    sampling.add_argument("--seed", type=int, help="sampling seed (default 0)")

    stops = parser.add_argument_group("stops")
    stops.add_argument(
        "--stop", action="append", metavar="S", help="content stop string (repeatable)"
    )
    stops.add_argument(
        "--reasoning-stop", action="append", metavar="S", help="reasoning stop string (repeatable)"
    )
    stops.add_argument(
        "--stop-token-id", action="append", type=int, metavar="N", help="stop token id (repeatable)"
    )

    prompt = parser.add_argument_group("prompt")
    prompt.add_argument(
        "--no-thinking", action="store_true", default=None, help="ask the template for no reasoning"
    )
    prompt.add_argument(
        "--reasoning-effort", help="template effort level, where the template has one"
    )

    debug = parser.add_argument_group("debug")
    debug.add_argument(
        "--raw-output",
        action="store_true",
        default=None,
        help="print the raw text (think tags included)",
    )
    debug.add_argument(
        "--print-token-ids",
        action="store_true",
        default=None,
        help="print the generated ids (stdout, last line)",
    )


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _read_messages(path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise NinferError(f"cannot read --messages file: {exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise NinferError(f"--messages {path} is not valid JSON: {exc}") from None
    if isinstance(data, list):
        messages, tools = data, None
    elif isinstance(data, dict) and isinstance(data.get("messages"), list):
        messages, tools = data["messages"], data.get("tools")
    else:
        raise NinferError(f"--messages {path} must hold a list of messages or {{messages, tools}}")
    messages = [_text_message(m, f"--messages {path}: message {i}") for i, m in enumerate(messages)]
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)
    ):
        raise NinferError(f"--messages {path}: 'tools' must be a list of objects")
    return messages, tools


def _text_message(message: Any, where: str) -> dict[str, Any]:
    """A message with a string role and text content: a string, or a list of text parts
    (joined, as the Qwen templates join them, so any template renders them); none at all only
    beside tool calls. Other content (an image, a number) a template would drop without a
    word."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise NinferError(f"{where} is not an object with a string 'role'")
    content = message.get("content")
    if isinstance(content, str) or (content is None and message.get("tool_calls")):
        return message
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return {**message, "content": "".join(part["text"] for part in content)}
    raise NinferError(f"{where}: 'content' must be text (a string or a list of text parts)")


def _engine_config(args: RunSettings):
    from ninfer.engine.config import EngineConfig, parse_kv_capacity

    if args.no_thinking and args.reasoning_effort:
        raise ConfigError("--reasoning-effort cannot be combined with --no-thinking")
    kv = args.max_context if args.kv_capacity is None else parse_kv_capacity(str(args.kv_capacity))
    return EngineConfig(
        max_context=args.max_context,
        max_concurrency=1,
        max_pending_requests=0,
        kv_capacity=kv,
        prefill_chunk=args.prefill_chunk,
        idle_prefill_chunk=args.idle_prefill_chunk,
        dtype=args.dtype,
        device=args.device,
        gdn_state_dtype=args.gdn_state_dtype,
        tensor_parallel=args.tensor_parallel,
        expert_parallel=args.expert_parallel,
        cuda_graph=not args.no_cuda_graph,
        overlap=not args.no_overlap,
    )


def _sampling(args: RunSettings, frontend: Any, thinking: bool):
    from ninfer.chat.presets import SamplingFields, resolve_sampling
    from ninfer.engine.request import SamplingParams

    preset = frontend.sampling_preset(thinking) if frontend is not None else SamplingFields()
    flags = SamplingFields(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )
    fields = resolve_sampling(preset, flags, greedy=args.greedy)
    return SamplingParams(
        temperature=fields.temperature,
        top_p=fields.top_p,
        top_k=fields.top_k,
        min_p=fields.min_p,
        presence_penalty=fields.presence_penalty,
        frequency_penalty=fields.frequency_penalty,
        seed=0 if fields.seed is None else fields.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        reasoning_stop=tuple(args.reasoning_stop),
        stop_token_ids=tuple(args.stop_token_id),
    )


def _build_request(args: RunSettings, inputs: argparse.Namespace, engine: Any):
    from ninfer.engine.request import GenerationRequest

    frontend = engine.frontend
    if inputs.prompt_ids is not None:
        if not inputs.prompt_ids:
            raise NinferError("--prompt-ids is empty")
        params = _sampling(args, frontend, thinking=False)
        return GenerationRequest(inputs.prompt_ids, params, detokenize=not args.raw_output)
    if frontend is None or not frontend.has_template:
        raise NinferError("the model has no tokenizer or chat template; use --prompt-ids")
    if inputs.prompt is not None:
        messages, tools = [{"role": "user", "content": inputs.prompt}], None
    else:
        messages, tools = _read_messages(inputs.messages)
    rendered = frontend.render(
        messages,
        tools=tools,
        enable_thinking=False if args.no_thinking else None,
        reasoning_effort=args.reasoning_effort,
    )
    params = _sampling(args, frontend, thinking=rendered.enable_thinking)
    return GenerationRequest(
        rendered.token_ids,
        params,
        starts_in_reasoning=rendered.starts_in_reasoning,
        detokenize=not args.raw_output,
    )


def run(inputs: argparse.Namespace) -> int:
    from ninfer.engine.engine import Engine, shipped_model_path

    args = settings_from(RunSettings, inputs, "run")
    config = _engine_config(args)
    path = Path(args.model) if args.model else shipped_model_path()
    _log(f"loading {path} ...")
    started = time.perf_counter()
    with Engine(path, config) as engine:
        device = engine.core.cache.k[0].device if engine.core.cache.k else "cpu"
        _log(f"loaded in {time.perf_counter() - started:.2f} s on {device}")
        request = _build_request(args, inputs, engine)
        raw = None
        if args.raw_output and engine.tokenizer is not None:
            from ninfer.chat.decoder import IncrementalDetokenizer

            raw = IncrementalDetokenizer(engine.tokenizer)
        out, err = sys.stdout, sys.stderr
        in_reasoning = False
        last = None
        token_ids: list[int] = []
        for event in engine.submit(request):
            token_ids += event.token_ids
            if raw is not None:
                out.write("".join(raw.push(t) for t in event.token_ids))
                if event.finished:
                    out.write(raw.flush())
            if event.reasoning:
                if not in_reasoning:
                    err.write("[reasoning] ")
                    in_reasoning = True
                err.write(event.reasoning)
                err.flush()
            if event.content:
                if in_reasoning:
                    err.write("\n")
                    in_reasoning = False
                out.write(event.content)
            out.flush()
            last = event
        if in_reasoning:
            err.write("\n")
        if raw is not None or (last is not None and engine.tokenizer is not None):
            out.write("\n")
        if args.print_token_ids:
            out.write(",".join(str(t) for t in token_ids) + "\n")
        out.flush()
        _report(last)
    return 0


def _report(event: Any) -> None:
    if event is None:
        return
    usage, t = event.usage, event.timings
    decoded = max(usage.completion_tokens - 1, 0)
    prefill_rate = usage.prompt_tokens / t.prefill if t.prefill > 0 else 0.0
    decode_rate = decoded / t.decode if t.decode > 0 else 0.0
    stop = f" ({event.stop_reason!r})" if event.stop_reason is not None else ""
    _log(
        f"finish: {event.finish_reason}{stop} | prompt {usage.prompt_tokens} tokens, "
        f"output {usage.completion_tokens} ({usage.reasoning_tokens} reasoning)"
    )
    _log(
        f"prefill {t.prefill:.3f} s ({prefill_rate:.1f} tok/s) | ttft {t.ttft:.3f} s | "
        f"decode {t.decode:.3f} s ({decode_rate:.1f} tok/s) | total {t.total:.3f} s"
    )
