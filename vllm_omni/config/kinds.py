"""The registry of stage kinds: what a stage config's `engine:` may name.

Each kind is a class implementing engine/stage.py's `StageKind`, registered by import path so
that reading a config imports an engine only when a stage of its kind is checked or started.
A plugin adds its own kind with `register_stage_kind("name", "package.module:Class")`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_omni.config.memory import MemoryPlan
    from vllm_omni.config.schema import StageConfig
    from vllm_omni.engine.stage import Stage, StageKind

_KINDS: dict[str, str] = {
    "ar": "vllm_omni.engine.ar.stage:ARStage",
    "diffusion": "vllm_omni.engine.diffusion.stage:DiffusionStage",
    "code2wav": "vllm_omni.engine.code2wav.stage:Code2WavStage",
}


@dataclass
class StartContext:
    """What a stage is planned and started with beside its own config."""

    model: str  # the model the pipeline is served for (a stage's own `model` wins)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # the caller's engine args
    usage_context: Any = None  # vLLM's UsageContext
    cache_config: dict[str, Any] | None = None  # the server's step caching (diffusion)
    memory_plan: MemoryPlan | None = None  # set once planned, before stages start
    # Degrees for every diffusion stage (ulysses_degree, ring_degree, cfg_parallel_size),
    # over the stages' own engine_args (the CLI's --ulysses-degree...).
    diffusion_parallel: dict[str, int] | None = None
    # Where stages start: None, in this process through their kind; a Ray cluster's
    # launcher (cluster/stage.py) starts each as an actor and returns its proxy.
    launcher: Callable[[StageConfig, StartContext], Stage] | None = None


def start_stage(config: StageConfig, context: StartContext) -> Stage:
    """Start a stage where the context says: through its launcher, else its kind."""
    if context.launcher is not None:
        return context.launcher(config, context)
    return stage_kind(config.engine).start(config, context)


def register_stage_kind(name: str, path: str) -> None:
    """Make `engine: <name>` mean the stage class at `path` ('package.module:Class')."""
    if name in _KINDS and _KINDS[name] != path:
        raise ValueError(f"stage kind {name!r} is already {_KINDS[name]!r}")
    _KINDS[name] = path


def kind_names() -> list[str]:
    return sorted(_KINDS)


@cache
def stage_kind(name: str) -> StageKind:
    if name not in _KINDS:
        raise ValueError(f"unknown stage kind {name!r}; known: {kind_names()}")
    module, _, cls = _KINDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
