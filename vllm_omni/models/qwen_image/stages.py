"""Input processors of the Qwen-Image pipelines (config/pipelines/qwen_image.yaml and
qwen_image_edit.yaml).

The encoder stage sees the prompt in the template diffusers' pipeline wraps it in (for
Qwen-Image-Edit, with the input image resized as the pipeline resizes it); the DiT stage gets
the encoder's hidden states as a connector handle and drops the template's first tokens
itself (DiffusionCore.add -> QwenImageAdapter.conditioning_from_states), so no tensor passes
through the process that runs these functions. An edit's input image goes to the DiT as
the request gave it: the DiT resizes and VAE-encodes it (QwenImageEditAdapter).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni.config.loader import diffusers_pipeline_class
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.processors import PromptGroup


@dataclass(frozen=True)
class PromptTemplate:
    text: str  # with one '{}' where the prompt goes
    drop: int  # template tokens at the start whose states the DiT does not see
    max_tokens: int  # prompt tokens the pipeline's tokenizer keeps (beyond `drop`)


@functools.cache
def bare_pipeline(pipeline_class: str) -> Any:
    """An instance of a diffusers pipeline class without components: its constants and
    helpers (template, image resizing) are the ones diffusers uses."""
    import diffusers

    cls = getattr(diffusers, pipeline_class)
    names = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    return cls(**dict.fromkeys(names))


@functools.cache
def prompt_template(pipeline_class: str) -> PromptTemplate:
    """The template of a diffusers Qwen-Image pipeline class, read from the pipeline itself."""
    pipe = bare_pipeline(pipeline_class)
    return PromptTemplate(pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx,
                          pipe.tokenizer_max_length)


def _text(prompt: Any, takes_image: bool = False) -> str:
    """The request's prompt text (a string, or vLLM's prompt dict; with other inputs only
    where the pipeline takes an image)."""
    if isinstance(prompt, dict) and prompt.get("multi_modal_data") and not takes_image:
        raise ValueError("QwenImagePipeline generates from text only; it takes no input "
                         "image (editing is Qwen-Image-Edit's: QwenImageEditPipeline)")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    raise ValueError("Qwen-Image takes a text prompt")


def _images(prompt: Any) -> list[Any]:
    """The request's input images (vLLM's multi_modal_data: one image or a list)."""
    data = (prompt.get("multi_modal_data") or {}) if isinstance(prompt, dict) else {}
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise ValueError(f"Qwen-Image-Edit takes an image, not {unknown}")
    images = data.get("image") or []
    return list(images) if isinstance(images, list | tuple) else [images]


def _edit_image(prompt: Any) -> Any:
    images = _images(prompt)
    if len(images) != 1:
        raise ValueError("Qwen-Image-Edit edits one input image (multi_modal_data 'image'); "
                         f"the request has {len(images)}")
    return images[0]


def _negative_prompt(params: dict[str, Any]) -> str | None:
    """The negative prompt of a request that runs true CFG (as diffusers decides: a
    negative prompt and true_cfg_scale > 1, the pipeline's default when not given)."""
    for p in params.values():
        negative = getattr(p, "negative_prompt", None)
        scale = getattr(p, "true_cfg_scale", None)
        if negative is not None and (scale is None or scale > 1):
            return negative
    return None


def _pipeline_class(stage: Any) -> str:
    folder = Path(stage.info.model_config.model).parent  # the encoder is the text_encoder folder
    pipeline_class = diffusers_pipeline_class(folder)
    if pipeline_class is None:
        raise ValueError(f"stage {stage.name!r}: {folder} is not a diffusers folder")
    return pipeline_class


def encoder_prompts(
    upstream: dict[str, OmniRequestOutput], prompt: Any, stage: Any, params: dict[str, Any]
) -> dict[str, Any] | PromptGroup:
    """The encoder's prompt: the request's in the pipeline's template; with true CFG, the
    negative prompt's too (two requests, batched by vLLM)."""
    template = prompt_template(_pipeline_class(stage))
    tokenizer = stage.renderer.get_tokenizer()

    def wrapped(text: str) -> dict[str, Any]:
        # Tokenized here to cut it as diffusers' tokenizer call does (truncation=True).
        ids = tokenizer.encode(template.text.format(text), add_special_tokens=True)
        return {"prompt_token_ids": ids[: template.max_tokens + template.drop]}

    text = _text(prompt)
    negative = _negative_prompt(params)
    if negative is None:
        return wrapped(text)
    return PromptGroup([wrapped(text), wrapped(negative)])


def edit_encoder_prompts(
    upstream: dict[str, OmniRequestOutput], prompt: Any, stage: Any, params: dict[str, Any]
) -> dict[str, Any] | PromptGroup:
    """Qwen-Image-Edit's encoder prompt: the prompt in the edit template (which holds one
    image placeholder) and the input image resized as the pipeline resizes it, which vLLM's
    processor (the folder's, models/qwen_image/encoder.py) expands into the vision tokens;
    with true CFG the negative prompt's too, with the same image."""
    from vllm_omni.engine.diffusion.adapters.qwen_image_edit import edit_size

    pipeline_class = _pipeline_class(stage)
    template = prompt_template(pipeline_class)
    tokenizer = stage.renderer.get_tokenizer()
    image = _edit_image(prompt)
    width, height = edit_size(image)
    resized = bare_pipeline(pipeline_class).image_processor.resize(image, height, width)

    def wrapped(text: str) -> dict[str, Any]:
        # Not cut: the edit pipeline's processor call does not truncate.
        ids = tokenizer.encode(template.text.format(text), add_special_tokens=True)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": resized}}

    text = _text(prompt, takes_image=True)
    negative = _negative_prompt(params)
    if negative is None:
        return wrapped(text)
    return PromptGroup([wrapped(text), wrapped(negative)])


def encoder_to_dit(
    upstream: dict[str, OmniRequestOutput], prompt: Any, stage: Any, params: dict[str, Any]
) -> dict[str, Any]:
    """The DiT's prompt: the text (for the record) and the encoder's states, the prompt's
    first and the negative prompt's second, as handles with their prompt lengths (vLLM's,
    with an image's placeholder expanded); an edit's input image as the request gave it."""
    (encoder,) = upstream.values()
    conditioning = []
    for part in encoder.parts or [encoder]:
        if "hidden_states" not in part.tensor_handles:
            raise ValueError("the encoder stage must output hidden_states")
        conditioning.append({"states": part.tensor_handles["hidden_states"],
                             "length": len(part.prompt_token_ids or [])})
    dit_prompt = {"prompt": _text(prompt, takes_image=True), "conditioning": conditioning}
    images = _images(prompt)
    if images:
        dit_prompt["multi_modal_data"] = {"image": images}
    return dit_prompt
