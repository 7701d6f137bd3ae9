"""Per-request parameters of a diffusion stage (the DiT counterpart of SamplingParams)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
    output: Literal["image", "latent"] = "image"

    def merged(self, defaults: dict) -> DiffusionParams:
        """These params over a stage's defaults (fields set here win)."""
        return DiffusionParams(**{**defaults, **self.model_dump(exclude_unset=True)})
