"""Adapters that let the engine drive a diffusers pipeline; `adapter_for` picks one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.engine.diffusion.adapters.base import DiffusionAdapter
from vllm_omni.engine.diffusion.adapters.flux import FluxAdapter
from vllm_omni.engine.diffusion.adapters.qwen_image import QwenImageAdapter
from vllm_omni.engine.diffusion.adapters.qwen_image_edit import QwenImageEditAdapter
from vllm_omni.engine.diffusion.adapters.sd3 import SD3Adapter
from vllm_omni.engine.diffusion.adapters.step import StepAdapter
from vllm_omni.engine.diffusion.adapters.wan import WanAdapter
from vllm_omni.engine.diffusion.adapters.whole import WholeRequestAdapter
from vllm_omni.engine.diffusion.executor import LocalTransformer, TransformerExecutor

if TYPE_CHECKING:
    from vllm_omni.engine.diffusion.parallel.driver import RankGroup

# Exact pipeline classes only: a subclass (img2img, inpaint, ...) has another __call__.
STEP_ADAPTERS: dict[str, type[StepAdapter]] = {
    "FluxPipeline": FluxAdapter,
    "StableDiffusion3Pipeline": SD3Adapter,
    "QwenImagePipeline": QwenImageAdapter,
    "QwenImageEditPipeline": QwenImageEditAdapter,
    "WanPipeline": WanAdapter,
}


def adapter_for(pipe: Any, device: str | torch.device,
                ranks: RankGroup | None = None) -> DiffusionAdapter:
    """The adapter for `pipe`, whose models run on `device` (also when offloaded between
    uses), with its transformer over `ranks` where the stage has several."""
    cls = STEP_ADAPTERS.get(type(pipe).__name__)
    if cls is None or not cls.supports(pipe):
        if ranks is not None:
            raise ValueError(f"{type(pipe).__name__} runs as whole requests: it cannot be "
                             "split between ranks")
        return WholeRequestAdapter(pipe)
    return cls(pipe, device, _executor(cls, pipe, ranks))


def _executor(cls: type[StepAdapter], pipe: Any, ranks: RankGroup | None) -> TransformerExecutor:
    if ranks is None:
        return LocalTransformer(pipe.transformer, cls.modulated_input)
    from vllm_omni.engine.diffusion.parallel.driver import ParallelTransformer

    spec = cls.transformer_spec
    if ranks.layout.sequence > 1 and spec.output_sequence_dim is None:
        raise ValueError(f"{type(pipe).__name__} has no sequence-parallel support")
    return ParallelTransformer(ranks, pipe.transformer, spec, cls.modulated_input)


__all__ = ["STEP_ADAPTERS", "DiffusionAdapter", "StepAdapter", "WholeRequestAdapter",
           "adapter_for"]
