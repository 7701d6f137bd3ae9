"""Where stages run: each stage's device, checked before any engine starts.

A stage's `placement` names its device (and optionally a memory budget, which the memory
plan in orchestrator/memory.py honours). Start-up fails with every problem at once, named by
stage: a device this machine lacks, or an AR stage on a device vLLM cannot put it on.
"""

from __future__ import annotations

from vllm_omni.config.kinds import stage_kind
from vllm_omni.config.schema import PipelineConfig, StageConfig

GIB = 1 << 30


class PlacementError(ValueError):
    """The pipeline's placement (devices or memory) cannot be honoured on this machine."""


def stage_device(stage: StageConfig, ar_device_type: str = "cpu") -> str:
    """The device a stage runs on: its placement's, else its engine's default (vLLM's
    platform for AR stages, the `device` engine option, CPU by default, for the others)."""
    if stage.placement is not None:
        device = stage.placement.device
    else:
        device = stage_kind(stage.engine).default_device(stage, ar_device_type)
    return "cuda:0" if device == "cuda" else device


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_problems(pipeline: PipelineConfig, ar_device_type: str) -> list[str]:
    """Every stage whose device cannot be had, as a sentence naming the stage."""
    problems: list[str] = []
    for stage in pipeline.stages:
        device, name = stage_device(stage, ar_device_type), repr(stage.name)
        if device.startswith("cuda"):
            count, index = _cuda_count(), int(device.split(":")[1])
            if index >= count:
                problems.append(f"stage {name}: device {device}, but this machine has "
                                f"{count} CUDA device(s)")
                continue
        problems += stage_kind(stage.engine).placement_problems(stage, device, ar_device_type)
    return problems
