"""Flux (FluxPipeline): CLIP pooled + T5 sequence conditioning, packed 2x2 latents."""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni.engine.diffusion.adapters.step import StepAdapter
from vllm_omni.engine.diffusion.executor import TransformerExecutor
from vllm_omni.engine.diffusion.parallel.rank import TransformerSpec
from vllm_omni.engine.diffusion.request import DiffusionRequest


class FluxAdapter(StepAdapter):
    family = "flux"
    transformer_spec = TransformerSpec(
        batched=("hidden_states", "timestep", "guidance", "pooled_projections",
                 "encoder_hidden_states"),
        sequence={"hidden_states": 1, "encoder_hidden_states": 1, "txt_ids": 0, "img_ids": 0},
        output_sequence_dim=1,
    )

    def __init__(self, pipe: Any, device: str | torch.device,
                 executor: TransformerExecutor) -> None:
        super().__init__(pipe, device, executor)
        # A model whose T5 tokenizer says it takes fewer tokens than the pipeline's default
        # (512) was trained with that many: pad to it, not to 512.
        self.max_sequence_length = min(
            self.max_sequence_length, pipe.tokenizer_2.model_max_length
        )

    @property
    def size_multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2

    def encode_texts(self, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=texts, prompt_2=None, device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        return [{"embeds": e[None], "pooled": p[None]} for e, p in zip(embeds, pooled, strict=True)]

    def initial_latents(self, req: DiffusionRequest, generator: torch.Generator) -> torch.Tensor:
        p = req.params
        latents, image_ids = self.pipe.prepare_latents(
            p.num_images, self.pipe.transformer.config.in_channels // 4, p.height, p.width,
            self.dtype, self.device, generator,
        )
        req.extras["image_ids"] = image_ids
        return latents

    def transformer_inputs(self, latents, t, conds, reqs, rows):
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:
            guidance = self._per_row([r.params.guidance_scale for r in reqs], rows, t).float()
        embeds = self._rows(conds, "embeds", rows)
        return {
            "hidden_states": latents,
            "timestep": t / 1000,
            "guidance": guidance,
            "pooled_projections": self._rows(conds, "pooled", rows),
            "encoder_hidden_states": embeds,
            "txt_ids": torch.zeros(embeds.shape[1], 3, device=self.device, dtype=embeds.dtype),
            "img_ids": reqs[0].extras["image_ids"],
        }

    def latents_to_image(self, latents, height, width):
        vae = self.pipe.vae
        latents = self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(latents, return_dict=False)[0]
