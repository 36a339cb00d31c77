"""Sampling presets from the artifact's generation_config.json and the precedence that combines
them with process flags and request fields: preset < process flags < request fields, with greedy
applied last."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

# Optional generation_config section with per-mode presets, for checkpoints whose recommended
# sampling differs between thinking and non-thinking output:
#   "ninfer_sampling_presets": {"thinking": {...}, "non_thinking": {...}}
# Each mode's fields override the top-level ones.
MODE_PRESETS_KEY = "ninfer_sampling_presets"


@dataclass(slots=True, frozen=True)
class SamplingFields:
    """Sampling settings where None means "not set at this level"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None

    def over(self, base: SamplingFields) -> SamplingFields:
        """`self` layered over `base`: each field set here wins."""
        changes = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(base, **{k: v for k, v in changes.items() if v is not None})


# What an unset field means once every level has had its say (no filtering, no penalties).
NEUTRAL = SamplingFields(
    temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0
)

_NUMERIC = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "presence_penalty": float,
    "frequency_penalty": float,
}


def _fields_from(section: dict[str, Any]) -> SamplingFields:
    values = {
        name: cast(section[name])
        for name, cast in _NUMERIC.items()
        if isinstance(section.get(name), int | float) and not isinstance(section[name], bool)
    }
    if section.get("do_sample") is False:
        values["temperature"] = 0.0
    return SamplingFields(**values)


def sampling_preset(generation_config: dict[str, Any] | None, thinking: bool) -> SamplingFields:
    """The preset for the resolved thinking mode. `do_sample: false` makes the preset greedy
    (temperature 0), as transformers' generate would."""
    config = generation_config or {}
    preset = _fields_from(config)
    modes = config.get(MODE_PRESETS_KEY)
    if isinstance(modes, dict):
        mode = modes.get("thinking" if thinking else "non_thinking")
        if isinstance(mode, dict):
            preset = _fields_from(mode).over(preset)
    return preset


def resolve_sampling(
    preset: SamplingFields,
    flags: SamplingFields | None = None,
    request: SamplingFields | None = None,
    greedy: bool = False,
) -> SamplingFields:
    """Every field set: request over flags over preset over `NEUTRAL`; `greedy` forces
    temperature 0 after all of them. The seed stays None unless some level sets it."""
    resolved = preset.over(NEUTRAL)
    for layer in (flags, request):
        if layer is not None:
            resolved = layer.over(resolved)
    if greedy:
        resolved = replace(resolved, temperature=0.0)
    return resolved
