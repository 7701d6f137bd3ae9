"""Qwen-Image-Edit's text encoder on vLLM: its Qwen2.5-VL, with the processor of the folder.

A diffusers folder keeps the encoder's weights in `text_encoder/` and its HF processor (image
sizes, patching, normalisation) in `processor/`; vLLM loads a model's processor from the
model's own folder, where there is none. This model class is vLLM's Qwen2.5-VL with one
change, registered through vLLM's public registries (the plugin's `ModelRegistry` entry, the
multimodal registry's processor): its processing info loads the processor from the sibling
`processor/` folder, so vLLM sees the image as diffusers' pipeline does. A stage selects it
with `hf_overrides: {architectures: [QwenImageEditTextEncoder]}`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
from vllm.model_executor.models.qwen2_5_vl import (
    Qwen2_5_VLDummyInputsBuilder,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLMultiModalProcessor,
    Qwen2_5_VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

ARCHITECTURE = "QwenImageEditTextEncoder"
# The component name in the pipeline's model_index.json.
PROCESSOR_FOLDER = "processor"


def processor_folder(text_encoder: str | Path) -> Path:
    """Where a diffusers folder keeps the processor of its text encoder."""
    return Path(text_encoder).parent / PROCESSOR_FOLDER


@functools.cache
def _processor(folder: str, tokenizer: Any) -> Qwen2_5_VLProcessor:
    # Qwen2.5-VL's processor class whatever the folder names (diffusers saves Qwen2-VL's):
    # for images the two are the same, and vLLM's Qwen2.5-VL code expects this one.
    return Qwen2_5_VLProcessor.from_pretrained(folder, tokenizer=tokenizer)


class QwenImageEditProcessingInfo(Qwen2_5_VLProcessingInfo):
    def get_hf_processor(self, **kwargs: object) -> Qwen2_5_VLProcessor:
        if kwargs:
            # Processor options at construction would need vLLM's own loader; the pipeline
            # passes none (its processor call takes the folder's settings).
            raise ValueError(f"{ARCHITECTURE} takes no processor options, got {sorted(kwargs)}")
        folder = processor_folder(self.ctx.model_config.model)
        return _processor(str(folder), self.get_tokenizer())


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2_5_VLMultiModalProcessor,
    info=QwenImageEditProcessingInfo,
    dummy_inputs=Qwen2_5_VLDummyInputsBuilder,
)
class QwenImageEditTextEncoder(Qwen2_5_VLForConditionalGeneration):
    """vLLM's Qwen2.5-VL, weights and all; only where its processor comes from differs."""
