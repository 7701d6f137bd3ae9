"""Qwen-Image (QwenImagePipeline): Qwen2.5-VL text features of varying length, true CFG with
the norm-preserving combination, a video-style VAE decoded one frame at a time."""

from __future__ import annotations

import torch

from vllm_omni.engine.diffusion.adapters.step import StepAdapter
from vllm_omni.engine.diffusion.parallel.rank import TransformerSpec
from vllm_omni.engine.diffusion.request import DiffusionRequest


class QwenImageAdapter(StepAdapter):
    family = "qwen-image"
    # No sequence split yet: its rotary table is built for the whole image inside.
    transformer_spec = TransformerSpec(
        batched=("hidden_states", "timestep", "encoder_hidden_states",
                 "encoder_hidden_states_mask", "img_shapes"),
        sequence={}, output_sequence_dim=None,
    )

    @property
    def size_multiple(self) -> int:
        return self.pipe.vae_scale_factor * 2

    def combine(self, pos, neg, reqs, rows):
        mixed = super().combine(pos, neg, reqs, rows)
        # Rescale so the guided prediction keeps the conditional one's norm, as the pipeline.
        return mixed * (pos.norm(dim=-1, keepdim=True) / mixed.norm(dim=-1, keepdim=True))

    @staticmethod
    def modulated_input(block, hidden, temb):
        shift_scale_gate = block.img_mod(temb).chunk(2, dim=-1)[0]
        return block._modulate(block.img_norm1(hidden), shift_scale_gate)[0]

    def encode_texts(self, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        embeds, mask = self.pipe.encode_prompt(
            prompt=texts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        lengths = [embeds.shape[1]] * len(texts) if mask is None else mask.sum(1).tolist()
        # Kept unpadded: a batch pads to its own longest text and masks the rest.
        return [{"embeds": e[None, :n]} for e, n in zip(embeds, lengths, strict=True)]

    def conditioning_from_states(self, tensors, length):
        # As the pipeline's encode_prompt: the last hidden states (after the final norm) of
        # the template-wrapped prompt, without the template's first tokens, then cut to the
        # longest text the pipeline takes.
        drop = self.pipe.prompt_template_encode_start_idx
        states = tensors["hidden_states"][drop:length][: self.max_sequence_length]
        return {"embeds": states[None].to(self.device, self.dtype)}

    def initial_latents(self, req: DiffusionRequest, generator: torch.Generator) -> torch.Tensor:
        p = req.params
        return self.pipe.prepare_latents(
            p.num_images, self.pipe.transformer.config.in_channels // 4, p.height, p.width,
            self.dtype, self.device, generator,
        )

    def transformer_inputs(self, latents, t, conds, reqs, rows):
        longest = max(c["embeds"].shape[1] for c in conds)
        embeds, masks = [], []
        for c, n in zip(conds, rows, strict=True):
            e = c["embeds"]
            pad = longest - e.shape[1]
            embeds.append(torch.nn.functional.pad(e, (0, 0, 0, pad)).expand(n, -1, -1))
            mask = torch.ones(n, longest, dtype=torch.long, device=e.device)
            mask[:, e.shape[1]:] = 0
            masks.append(mask)
        mask = torch.cat(masks)
        p = reqs[0].params
        f = self.pipe.vae_scale_factor * 2
        return {
            "hidden_states": latents,
            "timestep": t / 1000,
            "guidance": None,
            "encoder_hidden_states": torch.cat(embeds),
            "encoder_hidden_states_mask": None if bool(mask.all()) else mask,
            "img_shapes": [[(1, p.height // f, p.width // f)]] * latents.shape[0],
        }

    def latents_to_image(self, latents, height, width):
        vae = self.pipe.vae
        latents = self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)
        latents = latents.to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents)
        return vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
