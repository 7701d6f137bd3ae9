"""Stable Diffusion 3 (StableDiffusion3Pipeline): two CLIPs + T5, classifier-free guidance."""

from __future__ import annotations

import torch

from vllm_omni.engine.diffusion.adapters.step import StepAdapter
from vllm_omni.engine.diffusion.parallel.rank import TransformerSpec
from vllm_omni.engine.diffusion.params import DiffusionParams
from vllm_omni.engine.diffusion.request import DiffusionRequest


class SD3Adapter(StepAdapter):
    family = "sd3"
    # No sequence split: SD3 patches its latents inside the transformer.
    transformer_spec = TransformerSpec(
        batched=("hidden_states", "timestep", "encoder_hidden_states", "pooled_projections"),
        sequence={}, output_sequence_dim=None,
    )

    @property
    def size_multiple(self) -> int:
        return self.pipe.vae_scale_factor * self.pipe.transformer.config.patch_size

    def image_seq_len(self, height: int, width: int) -> int:
        f = self.pipe.vae_scale_factor * self.pipe.transformer.config.patch_size
        return (height // f) * (width // f)

    def sigmas(self, steps: int):
        return None  # SD3 lets the scheduler space its own timesteps

    def uses_cfg(self, p: DiffusionParams) -> bool:
        return p.guidance_scale > 1

    def needs_empty_negative(self, reqs) -> bool:
        return True  # SD3's unconditional branch encodes "" when no negative prompt is given

    def combine(self, pos, neg, reqs, rows):
        scale = self._per_row([r.params.guidance_scale for r in reqs], rows, pos)
        return neg + scale * (pos - neg)

    def encode_texts(self, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=texts, prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
        )
        return [{"embeds": e[None], "pooled": p[None]} for e, p in zip(embeds, pooled, strict=True)]

    def initial_latents(self, req: DiffusionRequest, generator: torch.Generator) -> torch.Tensor:
        p = req.params
        return self.pipe.prepare_latents(
            p.num_images, self.pipe.transformer.config.in_channels, p.height, p.width,
            self.dtype, self.device, generator,
        )

    def transformer_inputs(self, latents, t, conds, reqs, rows):
        return {
            "hidden_states": latents,
            "timestep": t,
            "encoder_hidden_states": self._rows(conds, "embeds", rows),
            "pooled_projections": self._rows(conds, "pooled", rows),
        }

    def latents_to_image(self, latents, height, width):
        vae = self.pipe.vae
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(latents, return_dict=False)[0]
