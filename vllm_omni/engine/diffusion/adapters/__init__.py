"""Adapters that let the engine drive a diffusers pipeline; `adapter_for` picks one."""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni.engine.diffusion.adapters.base import StepAdapter
from vllm_omni.engine.diffusion.adapters.flux import FluxAdapter
from vllm_omni.engine.diffusion.adapters.qwen_image import QwenImageAdapter
from vllm_omni.engine.diffusion.adapters.qwen_image_edit import QwenImageEditAdapter
from vllm_omni.engine.diffusion.adapters.sd3 import SD3Adapter
from vllm_omni.engine.diffusion.adapters.wan import WanAdapter
from vllm_omni.engine.diffusion.adapters.whole import WholeRequestAdapter

# Exact pipeline classes only: a subclass (img2img, inpaint, ...) has another __call__.
STEP_ADAPTERS: dict[str, type[StepAdapter]] = {
    "FluxPipeline": FluxAdapter,
    "StableDiffusion3Pipeline": SD3Adapter,
    "QwenImagePipeline": QwenImageAdapter,
    "QwenImageEditPipeline": QwenImageEditAdapter,
    "WanPipeline": WanAdapter,
}


def adapter_for(pipe: Any, device: str | torch.device) -> StepAdapter | WholeRequestAdapter:
    """The adapter for `pipe`, whose models run on `device` (also when offloaded between uses)."""
    cls = STEP_ADAPTERS.get(type(pipe).__name__)
    if cls is None or not cls.supports(pipe):
        return WholeRequestAdapter(pipe)
    return cls(pipe, device)


__all__ = ["STEP_ADAPTERS", "StepAdapter", "WholeRequestAdapter", "adapter_for"]
