"""Per-request parameters of a diffusion stage (the DiT counterpart of SamplingParams)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vllm_omni.engine.diffusion.cache.config import CacheConfig


class DiffusionParams(BaseModel):
    """What a caller may set per request; None means the model's (pipeline's) default.

    `guidance_scale` is the model's own guidance (classifier-free guidance for SD3, the
    distilled guidance embedding for Flux); `true_cfg_scale` > 1 with a negative prompt runs
    a second, unconditional branch (Flux, Qwen-Image).
    """

    model_config = ConfigDict(extra="forbid")

    negative_prompt: str | None = None
    height: int | None = Field(default=None, ge=8, le=4096)
    width: int | None = Field(default=None, ge=8, le=4096)
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    true_cfg_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    num_images: int = Field(default=1, ge=1, le=16)
    # Video pipelines (Wan): frames to make (the model says which counts it takes) and the
    # frame rate the video is played at (it changes no pixel; it is the video's metadata).
    num_frames: int | None = Field(default=None, ge=1, le=1025)
    fps: int | None = Field(default=None, ge=1, le=120)
    # How far an input image is noised before denoising (image-to-image pipelines).
    strength: float | None = Field(default=None, gt=0.0, le=1.0)
    output: Literal["image", "latent"] = "image"
    # Also the float images (or frames) the 8-bit ones were rounded from (N or F x H x W x 3
    # in [0, 1]): four times the bytes, so only where a caller asks.
    float_output: bool = False
    # Step caching; fields given here override the server's --cache-config field by field.
    cache: CacheConfig | None = None
    # Lower is served first where the stage's scheduling_policy is "priority" (vLLM's
    # convention); ignored under "fcfs".
    priority: int = 0
    # A LoRA adapter the stage has loaded (by name), and the weight of its delta.
    lora: str | None = None
    lora_scale: float = Field(default=1.0, ge=-16.0, le=16.0)

    @classmethod
    def parse(cls, data: dict[str, Any]) -> DiffusionParams:
        """Validate; a bad field is a ValueError whose message names it (a 400 when served)."""
        try:
            return cls(**data)
        except ValidationError as e:
            problems = [f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
            raise ValueError("; ".join(problems)) from None

    def merged(self, defaults: dict) -> DiffusionParams:
        """These params over a stage's defaults (fields set here win, `cache` field by field)."""
        given = self.model_dump(exclude_unset=True)
        if isinstance(defaults.get("cache"), dict) and "cache" in given:
            given["cache"] = {**defaults["cache"], **(given["cache"] or {"method": "none"})}
        return DiffusionParams.parse({**defaults, **given})
