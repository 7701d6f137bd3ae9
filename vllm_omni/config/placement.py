"""Where stages run: checked before any engine starts, then turned into engine settings.

A stage's `placement` names its device and, optionally, a memory budget for everything it
holds (weights, KV cache, activations). Start-up fails with every problem at once, named by
stage: a device this machine lacks, a budget smaller than the stage's weights, or stages
whose budgets together exceed what their device has. The budget is then enforced through
each engine's own setting: vLLM's `kv_cache_memory_bytes` (CPU) or `gpu_memory_utilization`
(CUDA) for AR stages, the device for diffusion stages.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from vllm_omni.config.schema import PipelineConfig, StageConfig

GIB = 1 << 30
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth"}


class PlacementError(ValueError):
    """The pipeline's placement cannot be honoured on this machine."""


def weights_bytes(model: str) -> int:
    """Bytes of weight files under a model folder (0 where it is not a local folder)."""
    folder = Path(model)
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.rglob("*") if f.suffix in _WEIGHT_SUFFIXES)


def _device(stage: StageConfig) -> str:
    device = stage.placement.device
    return "cuda:0" if device == "cuda" else device


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_memory(device: str) -> tuple[int, str]:
    """Bytes a device can give now, and what they are."""
    if device == "cpu":
        import psutil

        return psutil.virtual_memory().available, "of RAM available"
    import torch

    free, _ = torch.cuda.mem_get_info(int(device.split(":")[1]))
    return free, "free"


def check_placement(pipeline: PipelineConfig, model: str, ar_device_type: str) -> None:
    """Raise PlacementError listing every stage whose placement cannot be honoured."""
    problems: list[str] = []
    budgets: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for stage in pipeline.stages:
        if stage.placement is None:
            continue
        device, name = _device(stage), repr(stage.name)
        if device.startswith("cuda"):
            count, index = _cuda_count(), int(device.split(":")[1])
            if index >= count:
                problems.append(f"stage {name}: device {device}, but this machine has "
                                f"{count} CUDA device(s)")
                continue
        if stage.engine == "ar":
            if device.split(":")[0] != ar_device_type:
                problems.append(f"stage {name}: device {device}, but this vLLM build runs "
                                f"on {ar_device_type}")
                continue
            if device.startswith("cuda") and device != "cuda:0":
                problems.append(f"stage {name}: vLLM runs an AR stage on the first visible "
                                f"GPU; for {device}, start with CUDA_VISIBLE_DEVICES instead")
                continue
        memory = stage.placement.memory_gib
        if memory is None:
            continue
        if stage.engine == "ar" and device == "cpu" and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            problems.append(f"stage {name}: VLLM_CPU_KVCACHE_SPACE is set, and vLLM lets it "
                            "override the stage's memory_gib; unset it")
        weights = weights_bytes(stage.model or model)
        if weights >= memory * GIB:
            problems.append(f"stage {name}: its weights take {weights / GIB:.3g} GiB, "
                            f"not less than its memory_gib {memory}")
        budgets[device].append((stage.name, memory))
    for device, stages in budgets.items():
        total = sum(m for _, m in stages)
        have, what = device_memory(device)
        if total * GIB > have:
            problems.append(f"{device}: stages {[n for n, _ in stages]} ask for {total:.2f} GiB "
                            f"together; it has {have / GIB:.2f} GiB {what}")
    if problems:
        raise PlacementError("the pipeline's placement cannot be honoured:\n  "
                             + "\n  ".join(problems))


def ar_placement_args(stage: StageConfig, model: str) -> dict[str, Any]:
    """vLLM engine args that hold an AR stage to its memory budget."""
    if stage.placement is None or stage.placement.memory_gib is None:
        return {}
    budget = int(stage.placement.memory_gib * GIB)
    device = _device(stage)
    if device == "cpu":
        return {"kv_cache_memory_bytes": budget - weights_bytes(stage.model or model)}
    import torch

    total = torch.cuda.get_device_properties(int(device.split(":")[1])).total_memory
    return {"gpu_memory_utilization": budget / total}
