"""Load pipeline configs from YAML and pick the built-in pipeline for a model folder."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from vllm_omni.config.schema import PipelineConfig

BUILTIN_DIR = Path(__file__).parent / "pipelines"
DEFAULT_PIPELINE = "llm"
# A diffusers-format folder (model_index.json) is served by one diffusion stage.
DIFFUSERS_PIPELINE = "diffusion"


def load_function(path: str) -> Any:
    """The function a 'package.module:function' string of a pipeline config names."""
    module, _, func = path.partition(":")
    return getattr(importlib.import_module(module), func)


class PipelineConfigError(ValueError):
    """A pipeline config that cannot be used; the message names the file, stage and field."""


def _describe(loc: tuple, data: object) -> str:
    """'stage 'talker' (stages[1]), field 'engine_args'' from a pydantic error location."""
    parts = []
    if len(loc) >= 2 and loc[0] == "stages" and isinstance(loc[1], int):
        stage = data.get("stages", [])[loc[1]] if isinstance(data, dict) else None
        name = stage.get("name") if isinstance(stage, dict) else None
        parts.append(f"stage {name!r} (stages[{loc[1]}])" if name else f"stages[{loc[1]}]")
        loc = loc[2:]
    if loc:
        parts.append("field " + ".".join(str(x) for x in loc))
    return ", ".join(parts) or "pipeline"


def parse_pipeline(data: object, source: str) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        lines = [f"{source}: invalid pipeline config:"]
        for err in e.errors():
            lines.append(f"  {_describe(tuple(err['loc']), data)}: {err['msg']}")
        raise PipelineConfigError("\n".join(lines)) from None


def load_pipeline(path: str | Path) -> PipelineConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise PipelineConfigError(f"{path}: cannot read pipeline config: {e}") from None
    except yaml.YAMLError as e:
        raise PipelineConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_pipeline(data, str(path))


def builtin_pipelines() -> dict[str, PipelineConfig]:
    return {p.stem: load_pipeline(p) for p in sorted(BUILTIN_DIR.glob("*.yaml"))}


def model_architectures(model: str | Path) -> list[str]:
    config = Path(model) / "config.json"
    if not config.is_file():
        return []
    return list(json.loads(config.read_text()).get("architectures") or [])


def diffusers_pipeline_class(model: str | Path) -> str | None:
    """The diffusers pipeline class a diffusers folder names (None for other folders)."""
    index = Path(model) / "model_index.json"
    if not index.is_file():
        return None
    return json.loads(index.read_text()).get("_class_name")


def resolve_pipeline(model: str | Path, stage_configs_path: str | Path | None = None):
    """The pipeline to serve `model` with: the given file, else the built-in one for the
    model's HF architecture or diffusers pipeline class, the one-stage diffusion pipeline
    for other diffusers folders, else the one-stage LLM pipeline."""
    if stage_configs_path is not None:
        return load_pipeline(stage_configs_path)
    pipelines = builtin_pipelines()
    diffusers_class = diffusers_pipeline_class(model)
    if diffusers_class is not None:
        for pipeline in pipelines.values():
            if diffusers_class in pipeline.architectures:
                return pipeline
        return pipelines[DIFFUSERS_PIPELINE]
    archs = set(model_architectures(model))
    for pipeline in pipelines.values():
        if archs & set(pipeline.architectures):
            return pipeline
    return pipelines[DEFAULT_PIPELINE]
