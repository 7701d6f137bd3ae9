"""The registry of stage kinds: what a stage config's `engine:` may name.

Each kind is a class implementing engine/stage.py's `StageKind`, registered by import path so
that reading a config imports an engine only when a stage of its kind is checked or started
(and so that this layer imports nothing of the engines). A plugin adds its own kind with
`register_stage_kind("name", "package.module:Class")`.
"""

from __future__ import annotations

import importlib
from enum import StrEnum
from functools import cache
from typing import Any


class Capability(StrEnum):
    """What a stage kind can do beyond the contract every kind implements: its class lists
    them in `capabilities`, and configs, the memory plan and the server ask by name."""

    STREAMED_INPUT = "streamed_input"  # takes `stream_inputs` edges (chunks via add_input)
    HIDDEN_STATES = "hidden_states"  # the `hidden_states` and `step_inputs` options
    SUBFOLDER = "subfolder"  # a model in a subfolder of the pipeline's model folder
    KV_CACHE = "kv_cache"  # holds a KV cache the memory plan sizes
    TEXT_ANSWER = "text_answer"  # its text can answer a request (takes OpenAI's fields)
    ADAPTERS = "adapters"  # serves LoRA adapters per request: load_adapter / unload_adapter

_KINDS: dict[str, str] = {
    "ar": "vllm_omni.engine.ar.stage:ARStage",
    "diffusion": "vllm_omni.engine.diffusion.stage:DiffusionStage",
    "code2wav": "vllm_omni.engine.code2wav.stage:Code2WavStage",
}


def register_stage_kind(name: str, path: str) -> None:
    """Make `engine: <name>` mean the stage class at `path` ('package.module:Class')."""
    if name in _KINDS and _KINDS[name] != path:
        raise ValueError(f"stage kind {name!r} is already {_KINDS[name]!r}")
    _KINDS[name] = path


def kind_names() -> list[str]:
    return sorted(_KINDS)


@cache
def stage_kind(name: str) -> Any:
    """The class registered as `name` (a `StageKind`, engine/stage.py)."""
    if name not in _KINDS:
        raise ValueError(f"unknown stage kind {name!r}; known: {kind_names()}")
    module, _, cls = _KINDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
