"""The non-autoregressive engine: diffusion (DiT) pipelines with step-level batching."""

from vllm_omni.engine.diffusion.client import AsyncDiffusionEngine
from vllm_omni.engine.diffusion.core import DiffusionOutput, EngineOptions
from vllm_omni.engine.diffusion.params import DiffusionParams

__all__ = ["AsyncDiffusionEngine", "DiffusionOutput", "DiffusionParams", "EngineOptions"]
