"""Input processors of the Qwen-Image pipeline (config/pipelines/qwen_image.yaml).

The encoder stage sees the prompt in the template diffusers' pipeline wraps it in; the DiT
stage gets the encoder's hidden states as a connector handle and drops the template's first
tokens itself (DiffusionCore.add -> QwenImageAdapter.conditioning_from_states), so no tensor
passes through the process that runs these functions.
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
def prompt_template(pipeline_class: str) -> PromptTemplate:
    """The template of a diffusers Qwen-Image pipeline class, read from the pipeline itself
    (an instance without components), so it is the one diffusers uses."""
    import diffusers

    cls = getattr(diffusers, pipeline_class)
    names = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
    pipe = cls(**dict.fromkeys(names))
    return PromptTemplate(pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx,
                          pipe.tokenizer_max_length)


def _text(prompt: Any) -> str:
    """The request's prompt text (a string, or vLLM's prompt dict without other inputs)."""
    if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
        raise ValueError("QwenImagePipeline generates from text only; it takes no input "
                         "image (editing is Qwen-Image-Edit's, not served on two stages yet)")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    raise ValueError("Qwen-Image takes a text prompt")


def _negative_prompt(params: dict[str, Any]) -> str | None:
    """The negative prompt of a request that runs true CFG (as diffusers decides: a
    negative prompt and true_cfg_scale > 1, the pipeline's default when not given)."""
    for p in params.values():
        negative = getattr(p, "negative_prompt", None)
        scale = getattr(p, "true_cfg_scale", None)
        if negative is not None and (scale is None or scale > 1):
            return negative
    return None


def encoder_prompts(
    upstream: dict[str, OmniRequestOutput], prompt: Any, stage: Any, params: dict[str, Any]
) -> dict[str, Any] | PromptGroup:
    """The encoder's prompt: the request's in the pipeline's template; with true CFG, the
    negative prompt's too (two requests, batched by vLLM)."""
    folder = Path(stage.model_config.model).parent  # the encoder is the text_encoder folder
    pipeline_class = diffusers_pipeline_class(folder)
    if pipeline_class is None:
        raise ValueError(f"stage {stage.name!r}: {folder} is not a diffusers folder")
    template = prompt_template(pipeline_class)
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


def encoder_to_dit(
    upstream: dict[str, OmniRequestOutput], prompt: Any, stage: Any, params: dict[str, Any]
) -> dict[str, Any]:
    """The DiT's prompt: the text (for the record) and the encoder's states, the prompt's
    first and the negative prompt's second, as handles with their prompt lengths."""
    (encoder,) = upstream.values()
    conditioning = []
    for part in encoder.parts or [encoder]:
        if "hidden_states" not in part.tensor_handles:
            raise ValueError("the encoder stage must output hidden_states")
        conditioning.append({"states": part.tensor_handles["hidden_states"],
                             "length": len(part.prompt_token_ids or [])})
    return {"prompt": _text(prompt), "conditioning": conditioning}
