"""Qwen-Image-Edit (QwenImageEditPipeline): Qwen-Image conditioned on an input image twice,
through the text encoder's vision tower (an upstream stage) and as VAE latents that the
transformer reads beside the noise.

As the pipeline's `__call__`: the input image is resized to the area below (its aspect
kept, sides multiples of 32), VAE-encoded (the distribution's mode, so no noise is drawn),
packed, and concatenated after the noise tokens; `img_shapes` names both grids, and only the
noise tokens' prediction is kept. The output size defaults to the resized image's.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

from vllm_omni.engine.diffusion.adapters.qwen_image import QwenImageAdapter
from vllm_omni.engine.diffusion.request import DiffusionRequest

# The pixels the pipeline resizes the input image to: a literal in its `__call__`
# (`calculate_dimensions(1024 * 1024, ...)`), not an attribute that can be read. The tests
# compare with the pipeline's images, which would differ if diffusers changed it.
EDIT_AREA = 1024 * 1024


def edit_size(image: Any) -> tuple[int, int]:
    """(width, height) the pipeline resizes an input image (PIL) to."""
    width, height, _ = calculate_dimensions(EDIT_AREA, image.size[0] / image.size[1])
    return width, height


class QwenImageEditAdapter(QwenImageAdapter):
    family = "qwen-image-edit"
    takes_images = True

    @staticmethod
    def supports(pipe: Any) -> bool:
        """Step-level only with the prompt encoded upstream (the two-stage pipeline); a
        pipeline that encodes its own prompts and images runs as whole requests."""
        return pipe.text_encoder is None

    def check_inputs(self, images: list) -> None:
        if len(images) != 1:
            raise ValueError(f"{type(self.pipe).__name__} edits one input image; the request "
                             f"has {len(images)}")

    def input_defaults(self, images: list) -> dict[str, Any]:
        # The pipeline makes an image of the resized input's size unless told otherwise.
        width, height = edit_size(images[0])
        return {"height": height, "width": width}

    def conditioning_from_states(self, tensors, length):
        # As the edit pipeline's encode_prompt: without the template's first rows, and
        # (unlike the text-only pipeline) not cut to a maximum length.
        drop = self.pipe.prompt_template_encode_start_idx
        return {"embeds": tensors["hidden_states"][drop:length][None].to(self.device, self.dtype)}

    def initial_latents(self, req: DiffusionRequest, generator: torch.Generator) -> torch.Tensor:
        p, pipe = req.params, self.pipe
        width, height = edit_size(req.input_images[0])
        resized = pipe.image_processor.resize(req.input_images[0], height, width)
        pixels = pipe.image_processor.preprocess(resized, height, width).unsqueeze(2)
        latents, image_latents = pipe.prepare_latents(
            pixels, p.num_images, pipe.transformer.config.in_channels // 4, p.height, p.width,
            self.dtype, self.device, generator,
        )
        f = pipe.vae_scale_factor * 2
        req.extras["image_latents"] = image_latents
        req.extras["image_grid"] = (1, height // f, width // f)
        return latents

    def prepare(self, req: DiffusionRequest) -> None:
        super().prepare(req)
        # The image tokens ride along in every transformer call.
        req.cost += req.extras["image_latents"].shape[1] * req.params.num_images

    def batch_key(self, req: DiffusionRequest) -> tuple:
        # The transformer's rotary table follows the first row's grids: a batch shares them.
        return (*super().batch_key(req), req.extras["image_grid"])

    def transformer_inputs(self, latents, t, conds, reqs, rows):
        inputs = super().transformer_inputs(latents, t, conds, reqs, rows)
        images = torch.cat([r.extras["image_latents"] for r in reqs])
        inputs["hidden_states"] = torch.cat([latents, images], dim=1)
        (noise_grid,) = inputs["img_shapes"][0]
        inputs["img_shapes"] = [[noise_grid, reqs[0].extras["image_grid"]]] * latents.shape[0]
        return inputs

    def run_transformer(self, inputs, slots, timesteps, cfg):
        out = super().run_transformer(inputs, slots, timesteps, cfg)
        frames, height, width = inputs["img_shapes"][0][0]
        return out[:, : frames * height * width]  # the noise tokens' prediction
