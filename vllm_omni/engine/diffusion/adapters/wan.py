"""Wan 2.x text-to-video (WanPipeline): UMT5 text features, classifier-free guidance on
`guidance_scale`, 5-D video latents (channels, latent frames, height, width) decoded by Wan's
causal video VAE into frames."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from vllm_omni.engine.diffusion.adapters.step import StepAdapter
from vllm_omni.engine.diffusion.executor import TransformerExecutor
from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.engine.diffusion.request import DiffusionRequest

# Wan 2.1 was trained on 16 frames per second; the model folder does not record it.
DEFAULT_FPS = 16


class WanAdapter(StepAdapter):
    family = "wan"
    makes_video = True

    @staticmethod
    def supports(pipe: Any) -> bool:
        """Wan 2.2's two-transformer (A14B) and per-token-timestep (TI2V) variants switch
        models or timesteps inside the loop: those run as whole requests."""
        return pipe.config.boundary_ratio is None and not pipe.config.expand_timesteps

    def __init__(self, pipe: Any, device: str | torch.device,
                 executor: TransformerExecutor) -> None:
        super().__init__(pipe, device, executor)
        call = inspect.signature(type(pipe).__call__).parameters
        self.defaults.update(num_frames=call["num_frames"].default, fps=DEFAULT_FPS)
        del self.defaults["true_cfg_scale"]  # Wan has only guidance_scale
        self.frame_step = pipe.vae_scale_factor_temporal

    def default_size(self, call: dict[str, inspect.Parameter]) -> tuple[int, int]:
        return call["height"].default, call["width"].default

    @property
    def size_multiple(self) -> int:
        return self.pipe.vae_scale_factor_spatial * self.pipe.transformer.config.patch_size[1]

    def resolve(self, params: DiffusionParams) -> DiffusionParams:
        if params.true_cfg_scale is not None:
            raise ValueError("Wan guides with guidance_scale (and negative_prompt); it has no "
                             "true_cfg_scale")
        if params.num_images != 1:
            raise ValueError("a Wan request makes one video; send several requests for more")
        p = super().resolve(params)
        if p.num_frames % self.frame_step != 1:
            raise ValueError(
                f"num_frames must be {self.frame_step}k+1 for this model (1, "
                f"{self.frame_step + 1}, {2 * self.frame_step + 1}, ...), got {p.num_frames}")
        return p

    @staticmethod
    def modulated_input(block, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        # Wan's block: shift and scale of its self-attention from its table plus the step's
        # projection (batch, 6, dim), over a plain layer norm.
        shift, scale = (block.scale_shift_table + temb.float()).chunk(6, dim=1)[:2]
        return block.norm1(hidden.float()) * (1 + scale) + shift

    def sigmas(self, steps: int):
        return None  # as the pipeline: the scheduler spaces its own timesteps

    def uses_cfg(self, p: DiffusionParams) -> bool:
        return p.guidance_scale > 1

    def needs_empty_negative(self, reqs: list[DiffusionRequest]) -> bool:
        # The unconditional branch encodes "" when a request gives no negative prompt.
        return any(self.uses_cfg(r.params) and not r.params.negative_prompt for r in reqs)

    def combine(self, pos, neg, reqs, rows):
        scale = self._per_row([r.params.guidance_scale for r in reqs], rows, pos)
        return neg + scale * (pos - neg)

    def encode_texts(self, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        # Padded with zeros to max_sequence_length whatever the batch: rows are independent.
        embeds, _ = self.pipe.encode_prompt(
            prompt=texts, do_classifier_free_guidance=False, device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        return [{"embeds": e[None].to(self.dtype)} for e in embeds]

    def image_seq_len(self, height: int, width: int) -> int:
        """Latent tokens of one latent frame."""
        return (height // self.size_multiple) * (width // self.size_multiple)

    def initial_latents(self, req: DiffusionRequest, generator: torch.Generator) -> torch.Tensor:
        p = req.params
        # float32 whatever the model's dtype, as the pipeline keeps its latents.
        return self.pipe.prepare_latents(
            1, self.pipe.transformer.config.in_channels, p.height, p.width, p.num_frames,
            torch.float32, self.device, generator,
        )

    def prepare(self, req: DiffusionRequest) -> None:
        super().prepare(req)
        p = req.params
        req.cost = ((p.num_frames - 1) // self.frame_step + 1) * self.image_seq_len(
            p.height, p.width)

    def batch_key(self, req: DiffusionRequest) -> tuple:
        p = req.params
        return (p.height, p.width, p.num_frames, self.uses_cfg(p))

    def transformer_inputs(self, latents, t, conds, reqs, rows):
        return {
            "hidden_states": latents.to(self.dtype),
            "timestep": t,
            "encoder_hidden_states": self._rows(conds, "embeds", rows),
        }

    def decode(self, reqs: list[DiffusionRequest]) -> None:
        """VAE-decode finished videos (same size and length) into float frames in [0, 1]."""
        vae = self.pipe.vae
        latents = torch.cat([r.latents for r in reqs]).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
        frames = self.pipe.video_processor.postprocess_video(video, output_type="np")
        for r, v in zip(reqs, frames, strict=True):
            r.video = v
