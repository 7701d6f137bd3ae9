"""The fallback for pipelines without a step-level adapter: whole requests, batched when
their settings are identical (one pipeline call, one generator per image)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from vllm_omni.engine.diffusion.adapters.base import DiffusionAdapter
from vllm_omni.engine.diffusion.cache import CacheConfig
from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.engine.diffusion.request import DiffusionRequest

# DiffusionParams fields passed to the pipeline under the same name, when it takes them.
_CALL_FIELDS = (
    "negative_prompt", "height", "width", "num_inference_steps", "guidance_scale",
    "true_cfg_scale", "strength", "num_frames",
)
# Frames per second of a video whose model does not say (Wan 2.1's rate).
VIDEO_FPS = 16


class WholeRequestAdapter(DiffusionAdapter):
    """Runs `pipeline(...)` as it is, in this process; to the scheduler each request is a
    single step."""

    family = "whole-request"
    step_level = False

    def __init__(self, pipe: Any) -> None:
        super().__init__(pipe)
        self.accepted = set(inspect.signature(type(pipe).__call__).parameters)
        # Video pipelines (Wan) count videos, not images, and return frames.
        self.makes_video = "num_videos_per_prompt" in self.accepted
        self.per_prompt = "num_videos_per_prompt" if self.makes_video else "num_images_per_prompt"
        # Frames the VAE compresses into one latent frame: a video's length must be a
        # multiple of it plus one (Wan: 4k+1), which the pipeline would otherwise round.
        self.frame_step = getattr(pipe, "vae_scale_factor_temporal", None)
        if self.makes_video:
            call = inspect.signature(type(pipe).__call__).parameters
            self.defaults.update({n: call[n].default for n in ("height", "width", "num_frames")
                                  if n in call and isinstance(call[n].default, int)})
            self.defaults["fps"] = VIDEO_FPS
        # PixArt and Sana snap the size to a table of trained resolutions, then resize the
        # image; the engine makes the size asked for.
        self.fixed = ({"use_resolution_binning": False}
                      if "use_resolution_binning" in self.accepted else {})

    def resolve(self, params: DiffusionParams) -> DiffusionParams:
        refused = sorted(
            f for f in params.model_fields_set if f in _CALL_FIELDS and f not in self.accepted
        )
        if refused:
            raise ValueError(f"{type(self.pipe).__name__} does not take {refused}")
        if params.fps is not None and not self.makes_video:
            raise ValueError(f"{type(self.pipe).__name__} makes images, not videos: fps does "
                             "not apply")
        if self.makes_video and params.num_images != 1:
            raise ValueError("a video request makes one video; send several requests for more")
        if params.output == "latent":
            raise ValueError("latent output needs a step-level adapter; this model has none")
        if params.cache is not None:
            self.check_cache(params.cache)
        p = params.merged(self.defaults)
        step = self.frame_step if self.makes_video else None
        if step and p.num_frames is not None and p.num_frames % step != 1:
            raise ValueError(f"num_frames must be {step}k+1 for this model (1, {step + 1}, "
                             f"{2 * step + 1}, ...), got {p.num_frames}")
        return p

    def default_area(self) -> int | None:
        """Pixels of one image at the pipeline's default size, where its signature or its
        `default_sample_size` says it (None: unknown, no limit)."""
        call = inspect.signature(type(self.pipe).__call__).parameters
        sides = [call[n].default if n in call else None for n in ("height", "width")]
        if all(isinstance(s, int) for s in sides):
            return sides[0] * sides[1]
        size = getattr(self.pipe, "default_sample_size", None)
        factor = getattr(self.pipe, "vae_scale_factor", None)
        return (size * factor) ** 2 if isinstance(size, int) and isinstance(factor, int) else None

    def conditioning_from_states(self, tensors: dict[str, torch.Tensor],
                                 length: int) -> dict[str, torch.Tensor]:
        raise ValueError(f"{type(self.pipe).__name__} runs whole requests: it takes no prompt "
                         "encoded upstream")

    def check_cache(self, config: CacheConfig) -> None:
        if config.enabled:
            raise ValueError(
                f"{type(self.pipe).__name__} cannot be cached: it runs as whole requests "
                "(no step-level adapter), so the engine never sees its steps"
            )

    @property
    def takes_images(self) -> bool:
        return "image" in self.accepted

    def prepare(self, req: DiffusionRequest) -> None:
        p = req.params
        req.timesteps = torch.zeros(1)
        settings = p.model_dump(include=set(_CALL_FIELDS), exclude_none=True)
        # Several images of one request come from one generator, which a batch of
        # per-image generators cannot reproduce: such a request runs alone.
        alone = req.request_id if p.num_images > 1 or req.input_images else None
        req.key = (tuple(sorted(settings.items())), alone)
        req.cost = p.num_images

    def denoise(self, reqs: list[DiffusionRequest]) -> None:
        p = reqs[0].params
        kwargs = p.model_dump(include=set(_CALL_FIELDS) & self.accepted, exclude_none=True)
        kwargs.update(self.fixed)
        if len(reqs) == 1:
            r = reqs[0]
            kwargs.update(prompt=r.prompt, generator=torch.Generator().manual_seed(p.seed))
            kwargs[self.per_prompt] = p.num_images
            if r.input_images:
                kwargs["image"] = r.input_images[0] if len(r.input_images) == 1 else r.input_images
        else:
            kwargs.update(prompt=[r.prompt for r in reqs],
                          generator=[torch.Generator().manual_seed(r.params.seed) for r in reqs])
            if "negative_prompt" in kwargs:
                kwargs["negative_prompt"] = [kwargs["negative_prompt"]] * len(reqs)
        result = self.pipe(**kwargs, output_type="np")
        videos = getattr(result, "frames", None) if self.makes_video else None
        start = 0
        for r in reqs:
            if videos is not None:  # one video per request
                r.video = videos[start]
            else:
                r.images = list(result.images[start : start + r.params.num_images])
            start += r.params.num_images
            r.step = 1
