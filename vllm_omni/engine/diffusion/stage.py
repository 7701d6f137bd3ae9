"""A diffusion stage: the pipeline-facing side of AsyncDiffusionEngine (as ARStage is of
AsyncLLM). It turns the engine's outputs into OmniRequestOutputs with PIL images."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import prometheus_client
import torch

from vllm_omni.config.schema import StageConfig
from vllm_omni.engine.diffusion.client import AsyncDiffusionEngine
from vllm_omni.engine.diffusion.core import EngineOptions
from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.engine.stage import EngineStage
from vllm_omni.outputs import OmniRequestOutput

logger = logging.getLogger(__name__)

STEPS = prometheus_client.Counter(
    "vllm_omni:diffusion_steps", "Denoising steps completed, per request step", ["stage"]
)
IMAGES = prometheus_client.Counter(
    "vllm_omni:diffusion_images", "Images (or latents) generated", ["stage"]
)

_OPTION_NAMES = {f.name for f in dataclasses.fields(EngineOptions)}
# vLLM engine args that mean the same for a diffusion engine.
_SHARED_ARGS = {"dtype"}


def engine_options(
    stage: StageConfig, engine_kwargs: dict[str, Any], cache_config: dict[str, Any] | None = None
) -> EngineOptions:
    """Options from the stage's YAML `engine_args`, then the caller's shared args (dtype);
    `cache_config` (the server's step caching) over the stage's default `cache` params."""
    given = {k: v for k, v in engine_kwargs.items() if k in _SHARED_ARGS}
    ignored = sorted(set(engine_kwargs) - _SHARED_ARGS)
    if ignored:
        logger.info("stage %r: vLLM engine args %s do not apply to diffusion", stage.name, ignored)
    options = {**stage.engine_args, **given}
    if stage.placement is not None:
        options.setdefault("device", stage.placement.device)
    if options.get("dtype") in (None, "auto"):
        options["dtype"] = "float32"
    defaults = {**stage.sampling_params, **options.get("defaults", {})}
    if cache_config:
        defaults["cache"] = {**(defaults.get("cache") or {}), **cache_config}
    options["defaults"] = defaults
    return EngineOptions(**options)


def split_prompt(prompt: Any) -> tuple[str, list[Any]]:
    """A diffusion prompt is a string, or a dict in vLLM's shape: 'prompt' and optional
    'multi_modal_data': {'image': one image or a list} for pipelines that take images."""
    if isinstance(prompt, str):
        return prompt, []
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        images = (prompt.get("multi_modal_data") or {}).get("image") or []
        return prompt["prompt"], images if isinstance(images, list) else [images]
    raise ValueError(f"a diffusion stage takes a text prompt, got {type(prompt).__name__}")


def to_pil(image: np.ndarray):
    from PIL import Image

    return Image.fromarray((image * 255).round().astype("uint8"))


class DiffusionStage(EngineStage):
    def __init__(
        self,
        config: StageConfig,
        model: str,
        engine_kwargs: dict[str, Any],
        cache_config: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        options = engine_options(config, engine_kwargs, cache_config)
        self.engine = AsyncDiffusionEngine(config.model or model, options)
        logger.info("stage %r serves %s", self.name, self.engine.info)

    def sampling_params(self, given: DiffusionParams | dict[str, Any] | None) -> DiffusionParams:
        if isinstance(given, DiffusionParams):
            return given
        return DiffusionParams.parse(given or {})

    async def render(self, prompts: list[Any]) -> list[Any]:
        return list(prompts)  # tokenization happens in the engine core, batched

    async def generate(
        self, request_id: str, prompt: Any, params: DiffusionParams
    ) -> AsyncIterator[OmniRequestOutput]:
        text, images = split_prompt(prompt)
        steps_seen = 0
        async for out in self.engine.generate(request_id, text, params, images):
            STEPS.labels(self.name).inc(out.step - steps_seen)
            steps_seen = out.step
            result = OmniRequestOutput(
                request_id=request_id,
                stage=self.name,
                output_type=self.config.output,
                finished=out.finished,
                prompt=text,
                metrics={"step": out.step, "num_steps": out.num_steps, "seed": out.seed,
                         "cache": out.cache},
            )
            if out.finished:
                result.images = [to_pil(i) for i in out.images or []]
                if out.images is not None:  # the exact float images, beside the 8-bit PIL ones
                    result.tensors = {"images": torch.from_numpy(np.stack(out.images))}
                if out.latents is not None:  # resolved only where a caller receives them
                    result.tensor_handles = {"latents": out.latents}
                IMAGES.labels(self.name).inc(params.num_images)
            yield result
