"""Hugging Face checkpoint directory -> `.ninfer` artifact. A recipe plans the logical tensors
and their formats; this module stores the HF config and the tokenizer files, then encodes and
writes the tensors one at a time (memory bounded by the largest tensor), and finally writes a
`<out>.conversion.json` report. On any failure no output file is left behind."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from ninfer.artifact.checkpoint import RESOURCE_FILES, Checkpoint
from ninfer.artifact.container import (
    DEFAULT_MAX_FILE_BYTES,
    ContainerWriter,
    ObjectPlan,
    move_no_overwrite,
)
from ninfer.artifact.recipes import ConversionPlan, TensorPlan, load_recipe
from ninfer.errors import ConversionError, ModelConfigError, NinferError, UnsupportedModelError
from ninfer.quant import EncodedTensor, WeightFormat, get_format
from ninfer.quant.groupwise import ENCODER, GroupwiseIntFormat

SLAB_ELEMENTS = 1 << 24  # rows are encoded in slabs of about this many values


def report_path(out: str | os.PathLike) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".conversion.json")


def _print_warning(message: str) -> None:
    print(f"ninfer convert: warning: {message}", file=sys.stderr)


def convert(
    model_dir: str | os.PathLike,
    recipe: str,
    out: str | os.PathLike,
    *,
    weights: str = "bf16",
    components: set[str] | None = None,
    name: str | None = None,
    resources: dict[str, str | os.PathLike] | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    on_warning: Callable[[str], None] = _print_warning,
    progress: bool | None = None,
) -> dict:
    """Convert and return the report (also written to `<out>.conversion.json`).

    `components` None means text, plus mtp when the checkpoint has `mtp.*` tensors.
    `progress` None shows a tqdm bar only when stderr is a terminal."""
    out = Path(out)
    report_file = report_path(out)
    for path in (out, report_file):
        if path.exists():
            raise ConversionError(f"{path}: already exists; refusing to overwrite")
    if not out.parent.is_dir():
        raise ConversionError(f"{out.parent}: output directory does not exist")
    checkpoint = Checkpoint(model_dir)
    recipe_obj = load_recipe(recipe)
    try:
        plan = recipe_obj.plan(checkpoint, components, weights)
    except NinferError:
        raise
    except (LookupError, TypeError, ValueError, AttributeError, ArithmeticError) as exc:
        # what a malformed config.json or index makes of the recipe's reading of it
        raise ConversionError(
            f"{model_dir}: the {recipe} recipe cannot read this checkpoint's config or tensors "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    try:
        _check_model(plan)
    except ModelConfigError as exc:
        raise ConversionError(f"{model_dir}: {exc}") from None
    warnings = list(plan.warnings)

    resource_bytes = _collect_resources(checkpoint, resources or {}, warnings)
    _check_text_side(resource_bytes)
    for message in warnings:
        on_warning(message)

    objects = [
        ObjectPlan.resource(f"resources/text/{role}", len(data))
        for role, data in resource_bytes.items()
    ]
    objects += [ObjectPlan.tensor(t.name, t.shape, t.format) for t in plan.tensors]
    components_json = {c: dict(spec) for c, spec in plan.components.items()}
    components_json["text"]["resources"] = {
        role: f"resources/text/{role}" for role in resource_bytes
    }
    formats_used = sorted({t.format for t in plan.tensors})
    provenance = {
        "converter": _version(),
        "source": str(Path(model_dir).resolve()),
        "recipe": getattr(recipe_obj, "name", recipe),
        "weights": weights,
        "components": sorted(plan.components),
        "skipped": plan.skipped,
    }
    if any(isinstance(get_format(f), GroupwiseIntFormat) for f in formats_used):
        provenance["encoder"] = ENCODER

    tensor_reports = []
    with ContainerWriter(
        out,
        objects,
        components=components_json,
        bindings={t.name: {"object": t.name} for t in plan.tensors},
        metadata={"name": name or Path(model_dir).resolve().name},
        provenance=provenance,
        max_file_bytes=max_file_bytes,
    ) as writer:
        for role, data in resource_bytes.items():
            writer.write(f"resources/text/{role}", data)
        bar = tqdm(
            plan.tensors,
            desc="convert",
            unit="tensor",
            file=sys.stderr,
            disable=None if progress is None else not progress,
        )
        for tensor_plan in bar:
            data, entry = _encode(tensor_plan, checkpoint)
            writer.write(tensor_plan.name, data)
            tensor_reports.append(entry)
            del data
        files = writer.finish()

    report = {
        "artifact": str(out),
        "files": [{"path": str(p), "bytes": p.stat().st_size} for p in files],
        "recipe": provenance["recipe"],
        "weights": weights,
        "components": sorted(plan.components),
        "resources": sorted(resource_bytes),
        "skipped": plan.skipped,
        "warnings": warnings,
        "formats": _format_totals(tensor_reports),
        "tensors": tensor_reports,
    }
    try:
        _write_new(report_file, json.dumps(report, indent=2).encode("utf-8") + b"\n")
    except BaseException:
        for path in files:
            path.unlink(missing_ok=True)
        raise
    return report


def _version() -> str:
    from ninfer import __version__

    return f"ninfer {__version__}"


def _check_model(plan: ConversionPlan) -> None:
    """What loading the artifact would refuse, refused before anything is written: the model
    that the text config names (`models.registry`) must find a tensor of its shape for each
    parameter among the planned ones. A config of a model this engine does not run (a recipe
    file's) is stored as planned."""
    from ninfer.models.qwen3_5 import Qwen3_5Config
    from ninfer.models.registry import model_class

    config = plan.components["text"]["config"]
    try:
        cls = model_class(config)
    except UnsupportedModelError:
        return
    shapes = {tensor.name: tensor.shape for tensor in plan.tensors}
    parsed = Qwen3_5Config.from_hf(config, is_moe=cls.is_moe)
    cls.check_shapes(parsed, "mtp" in plan.components, shapes.get)


def _check_text_side(resource_bytes: dict[str, bytes]) -> None:
    """The tokenizer files read as the engine reads them (`ChatFrontend`): a tokenizer.json
    that `tokenizers` cannot load, a config that is not JSON or a template that does not
    compile would fail every run of the artifact."""
    if "tokenizer" not in resource_bytes:
        return
    from ninfer.chat.frontend import ChatFrontend

    try:
        ChatFrontend(
            resource_bytes["tokenizer"],
            resource_bytes.get("tokenizer_config"),
            resource_bytes.get("chat_template"),
            resource_bytes.get("generation_config"),
        )
    except NinferError as exc:
        raise ConversionError(f"the tokenizer files: {exc}") from None
    except Exception as exc:  # tokenizers raises a bare Exception for a bad tokenizer.json
        raise ConversionError(
            f"the tokenizer files cannot be read: {type(exc).__name__}: {exc}"
        ) from None


def _collect_resources(
    checkpoint: Checkpoint, overrides: dict, warnings: list[str]
) -> dict[str, bytes]:
    paths: dict[str, Path] = dict(checkpoint.resource_files())
    for role, path in overrides.items():
        path = Path(path)
        if not path.is_file():
            raise ConversionError(f"--resource {role}={path}: no such file")
        paths[role] = path
    data = {role: path.read_bytes() for role, path in sorted(paths.items())}
    if "chat_template" not in data and "tokenizer_config" in data:
        try:
            template = json.loads(data["tokenizer_config"]).get("chat_template")
        except (json.JSONDecodeError, AttributeError):
            template = None
        if isinstance(template, str):
            data["chat_template"] = template.encode("utf-8")
    if "tokenizer" not in data:
        warnings.append(
            f"{checkpoint.dir}: no {RESOURCE_FILES['tokenizer']}; the artifact is ids-only (no tokenizer or chat template)"
        )
    return dict(sorted(data.items()))


def _encode(plan: TensorPlan, checkpoint: Checkpoint) -> tuple[torch.Tensor, dict]:
    fmt = get_format(plan.format)
    source = plan.load(checkpoint)
    entry = {
        "name": plan.name,
        "sources": list(plan.sources)
        if len(plan.sources) <= 4
        else [plan.sources[0], "...", plan.sources[-1]],
        "source_dtype": str(source.dtype).removeprefix("torch."),
        "shape": list(plan.shape),
        "format": plan.format,
        "bytes": fmt.encoded_nbytes(plan.shape),
    }
    try:
        if not fmt.quantized:
            encoded = fmt.encode(source)
        else:
            encoded, errors = _encode_slabs(fmt, source)
            entry.update(errors)
    except ValueError as exc:
        raise ConversionError(f"tensor {plan.name} ({plan.sources[0]}): {exc}") from None
    return fmt.to_bytes(encoded), entry


def _encode_slabs(fmt: WeightFormat, source: torch.Tensor) -> tuple[EncodedTensor, dict]:
    """Encode a slab of rows at a time, measuring the decode error as we go."""
    shape = tuple(source.shape)
    k = shape[-1] if shape else 1
    rows = source.reshape(-1, k)
    step = max(1, SLAB_ELEMENTS // max(k, 1))
    slabs, max_abs, err_sq, ref_sq = [], 0.0, 0.0, 0.0
    for start in range(0, rows.shape[0], step):
        slab = rows[start : start + step].to(torch.float32)
        planes = fmt.encode_rows(slab)
        diff = fmt.decode(planes, tuple(slab.shape), torch.float32) - slab
        if diff.numel():
            max_abs = max(max_abs, diff.abs().max().item())
        err_sq += diff.double().square().sum().item()
        ref_sq += slab.double().square().sum().item()
        slabs.append(planes)
    planes = (
        {key: torch.cat([s[key] for s in slabs]) for key in slabs[0]}
        if slabs
        else fmt.encode_rows(rows.float())
    )
    rel_rmse = math.sqrt(err_sq / ref_sq) if ref_sq else 0.0
    return EncodedTensor(fmt.name, fmt.layout, shape, planes), {
        "max_abs_error": max_abs,
        "rel_rmse": rel_rmse,
    }


def _format_totals(entries: list[dict]) -> dict[str, dict]:
    totals: dict[str, dict] = {}
    for entry in entries:
        t = totals.setdefault(entry["format"], {"tensors": 0, "bytes": 0, "params": 0})
        t["tensors"] += 1
        t["bytes"] += entry["bytes"]
        t["params"] += math.prod(entry["shape"])
    return totals


def _write_new(path: Path, data: bytes) -> None:
    temp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        temp.write_bytes(data)
        move_no_overwrite(temp, path)
    finally:
        temp.unlink(missing_ok=True)


__all__ = ["ConversionPlan", "convert", "report_path"]
