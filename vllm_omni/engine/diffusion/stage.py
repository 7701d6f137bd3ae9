"""A diffusion stage: the pipeline-facing side of AsyncDiffusionEngine (as ARStage is of
AsyncLLM). It turns the engine's outputs into OmniRequestOutputs with PIL images."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import prometheus_client
import torch
from PIL import Image

from vllm_omni.config.kinds import Capability
from vllm_omni.config.schema import StageConfig
from vllm_omni.engine.diffusion.client import AsyncDiffusionEngine
from vllm_omni.engine.diffusion.core import EngineOptions
from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.engine.diffusion.quantize import VLLM_NAMES, quantized_bytes
from vllm_omni.engine.memory import RUNTIME, TORCH_BYTES, StagePlan, read_config, weights_bytes
from vllm_omni.engine.stage import EngineStage, StageInfo, StartContext
from vllm_omni.outputs import OmniRequestOutput, VideoOutput

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
    stage: StageConfig, engine_kwargs: dict[str, Any], cache_config: dict[str, Any] | None = None,
    parallel: dict[str, int] | None = None, lora_modules: dict[str, str] | None = None,
) -> EngineOptions:
    """Options from the stage's YAML `engine_args`, then the caller's shared args (dtype)
    and parallel degrees; `cache_config` (the server's step caching) over the stage's
    default `cache` params."""
    given = {k: v for k, v in engine_kwargs.items() if k in _SHARED_ARGS}
    if engine_kwargs.get("quantization") in VLLM_NAMES:
        given["quantization"] = VLLM_NAMES[engine_kwargs["quantization"]]
    ignored = sorted(set(engine_kwargs) - _SHARED_ARGS - set(given))
    if ignored:
        logger.info("stage %r: vLLM engine args %s do not apply to diffusion", stage.name, ignored)
    options = {**stage.engine_args, **given, **(parallel or {})}
    if stage.placement is not None:
        options.setdefault("device", stage.placement.device)
        if stage.placement.cores:
            options.setdefault("cores", list(stage.placement.cores))
    if options.get("dtype") in (None, "auto"):
        options["dtype"] = "float32"
    defaults = {**stage.sampling_params, **options.get("defaults", {})}
    if cache_config:
        defaults["cache"] = {**(defaults.get("cache") or {}), **cache_config}
    options["defaults"] = defaults
    if lora_modules:
        options["lora_modules"] = {**options.get("lora_modules", {}), **lora_modules}
    return EngineOptions(**options)


def split_prompt(prompt: Any) -> tuple[str, list[Any], list[dict[str, Any]]]:
    """A diffusion prompt is a string, or a dict in vLLM's shape: 'prompt' and optional
    'multi_modal_data': {'image': one image or a list} for pipelines that take images, and
    'conditioning': the prompt already encoded by an upstream stage (hidden states as
    connector handles, the prompt's first, a negative prompt's second; see
    DiffusionCore.add)."""
    if isinstance(prompt, str):
        return prompt, [], []
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        images = (prompt.get("multi_modal_data") or {}).get("image") or []
        return (prompt["prompt"], images if isinstance(images, list) else [images],
                list(prompt.get("conditioning") or []))
    raise ValueError(f"a diffusion stage takes a text prompt, got {type(prompt).__name__}")


class DiffusionStage(EngineStage):
    """A stage run by our diffusion engine: a diffusers pipeline, batched step by step."""

    outputs: ClassVar[frozenset[str]] = frozenset({"image", "video", "latent"})
    capabilities: ClassVar[frozenset[str]] = frozenset({Capability.ADAPTERS})

    # -- the kind ------------------------------------------------------------------------

    @classmethod
    def check_engine_args(cls, args: dict[str, Any]) -> None:
        unknown = sorted(set(args) - _OPTION_NAMES)
        if unknown:
            raise ValueError(f"unknown diffusion engine options {unknown}")

    @classmethod
    def check_sampling_params(cls, params: dict[str, Any]) -> None:
        DiffusionParams.parse(params)  # raises, naming the field, when a value is wrong

    @classmethod
    def placement_problems(cls, config: StageConfig, device: str,
                           ar_device_type: str) -> list[str]:
        offload = config.engine_args.get("offload")
        if offload is not None and not device.startswith("cuda"):
            return [f"stage {config.name!r}: offload {offload!r} moves weights between a GPU "
                    f"and the CPU; this stage runs on {device}"]
        return []

    @classmethod
    def memory_needs(cls, config: StageConfig, context: StartContext, device: str) -> StagePlan:
        """Its weights at the engine's dtype, and the activations of a full batch at the
        model's default resolution. An estimate: the larger of the transformer's (16
        hidden-sized tensors per token, both guidance branches) and the VAE decoder's (3
        tensors of its first block's channels per pixel). A parallel stage's other ranks
        each hold a copy of the transformer; degrees the model or the machine cannot
        honour are the plan's `problems`."""
        from vllm_omni.engine.diffusion.parallel.layout import (
            Layout,
            parallel_problems,
            rank_devices,
        )

        options = engine_options(config, context.engine_kwargs, context.cache_config,
                                 context.diffusion_parallel, context.lora_modules)
        model = config.model or context.model
        world = Layout.of(options).world
        cores = sorted(options.cores or os.sched_getaffinity(0))
        problems = parallel_problems(config.name, options, model, device, cores)
        if problems:
            return StagePlan(stage=config.name, engine=config.engine, device=device, weights=0,
                             kv_cache=0, activations=0, runtime=0, ranks=world,
                             rank_devices=rank_devices(device, world), problems=problems)
        itemsize = TORCH_BYTES.get(options.dtype, 4)
        root = Path(config.model or context.model)
        dit = read_config(root / "transformer" / "config.json") or read_config(
            root / "unet" / "config.json")
        vae = read_config(root / "vae" / "config.json")
        inner = (dit.get("num_attention_heads", 0) * dit.get("attention_head_dim", 0)
                 or dit.get("hidden_size") or dit.get("inner_dim") or 1024)
        if "temperal_downsample" in vae:  # Qwen-Image's and Wan's VAEs
            scale, channels = 2 ** len(vae["temperal_downsample"]), vae.get("base_dim", 96)
        else:
            channels = (vae.get("block_out_channels") or [128])[0]
            scale = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
        latent_side = dit.get("sample_size") if isinstance(dit.get("sample_size"), int) else 128
        side = vae.get("sample_size") or latent_side * scale
        side = side[0] if isinstance(side, list) else side
        patch = dit.get("patch_size") or 2
        patch = max(patch[-1] if isinstance(patch, list) else patch, 2)  # Flux packs 2 x 2
        tokens = (side // scale // patch) ** 2
        per_image = max(2 * tokens * inner * itemsize * 16, side * side * channels * 3 * itemsize)
        transformer = weights_bytes(str(root / "transformer"), None, itemsize)
        weights = weights_bytes(str(root), None, itemsize) - sum(
            weights_bytes(str(root / c), None, itemsize) for c in options.skip_components)
        # A quantized transformer holds a byte per weight (every rank's copy).
        weights -= transformer - quantized_bytes(transformer, itemsize, options.quantization)
        if world > 1:
            weights += (world - 1) * quantized_bytes(transformer, itemsize, options.quantization)
        if options.offload:  # the device holds one model, or one block, at a time
            weights = max((weights_bytes(str(p), None, itemsize) for p in root.iterdir()
                           if p.is_dir()), default=weights)
        return StagePlan(
            stage=config.name, engine=config.engine, device=device, weights=weights,
            kv_cache=0, activations=per_image * options.max_batch_size,
            runtime=int(RUNTIME[("other", device[:4])]) * world, ranks=world,
            rank_devices=rank_devices(device, world),
        )

    @classmethod
    def start(cls, config: StageConfig, context: StartContext) -> DiffusionStage:
        return cls(config, context)

    # -- the stage -----------------------------------------------------------------------

    def __init__(self, config: StageConfig, context: StartContext) -> None:
        self.config = config
        self.name = config.name
        options = engine_options(config, context.engine_kwargs, context.cache_config,
                                 context.diffusion_parallel, context.lora_modules)
        self.engine = AsyncDiffusionEngine(config.model or context.model, options)
        facts = self.engine.info
        logger.info("stage %r serves %s", self.name, facts)
        self.info = StageInfo(
            name=config.name, engine=config.engine, output=config.output,
            defaults=dict(facts.get("defaults") or {}),
            inputs=("text", "image") if facts.get("takes_images") else ("text",),
            family=facts.get("family"), takes_images=bool(facts.get("takes_images")),
            step_level=bool(facts.get("step_level")), max_running=facts.get("max_running"),
            limits={k: facts.get(k) for k in ("size_multiple", "frame_step",
                                              "max_image_pixels")})

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter at `path` (on the stage's host) as `name`; ValueError when
        it does not fit the model."""
        await self.engine.control("load_lora", name=name, path=path)

    async def unload_adapter(self, name: str) -> None:
        await self.engine.control("unload_lora", name=name)

    @classmethod
    def request_params(cls, info: StageInfo,
                       given: DiffusionParams | dict[str, Any] | None) -> DiffusionParams:
        if isinstance(given, DiffusionParams):
            return given
        return DiffusionParams.parse(given or {})

    async def generate(
        self,
        request_id: str,
        prompt: Any,
        params: DiffusionParams,
        *,
        input_complete: bool = True,
        keep_hidden_states: bool = False,
    ) -> AsyncIterator[OmniRequestOutput]:
        if not input_complete:
            raise ValueError(f"stage {self.name!r} takes no streamed input")
        text, images, conditioning = split_prompt(prompt)
        steps_seen = 0
        given = params.model_dump(exclude_unset=True)
        engine_prompt = {"prompt": text, "conditioning": conditioning} if conditioning else text
        async for out in self.engine.generate(request_id, engine_prompt, given, images):
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
                images, floats = out.images, out.float_images
                if out.video is not None and self.config.output == "video":
                    result.video = VideoOutput([Image.fromarray(f) for f in out.video],
                                               out.fps)
                    if out.float_video is not None:
                        result.tensors = {"video": torch.from_numpy(out.float_video)}
                elif out.video is not None:  # a stage that outputs images: one per frame
                    images, floats = list(out.video), out.float_video
                result.images = [Image.fromarray(i) for i in images or []]
                if images and floats is not None:  # the floats the 8-bit images came from
                    result.tensors = {"images": torch.from_numpy(floats)}
                if out.handle is not None:  # resolved only where a caller receives them
                    result.tensor_handles = {"latents": out.handle}
                    # Latents asked of an image stage: the caller gets them (the
                    # orchestrator reads tensor outputs out of shared memory for it).
                    result.output_type = "latent"
                IMAGES.labels(self.name).inc(params.num_images)
            yield result
