"""Input processors between Qwen2.5-Omni's stages."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch

from vllm_omni.models.qwen2_5_omni.talker import SPEAKERS_FILE
from vllm_omni.outputs import OmniRequestOutput

DEFAULT_SPEAKER = "Chelsie"  # HF's default voice


@cache
def speakers(folder: str) -> dict[str, dict[str, Any]]:
    return torch.load(Path(folder) / SPEAKERS_FILE, map_location="cpu", weights_only=True)


def speaker_bos(folder: str, speaker: str | None) -> int:
    table = speakers(folder)
    name = speaker or (DEFAULT_SPEAKER if DEFAULT_SPEAKER in table else next(iter(table)))
    if name not in table:
        raise ValueError(f"unknown voice {name!r}; this model has {sorted(table)}")
    return int(table[name]["bos_token"])


def thinker_to_talker(
    upstream: dict[str, OmniRequestOutput], prompt: Any, stage: Any
) -> dict[str, Any]:
    """The talker's prompt: one codec mask per thinker prompt token, then codec pad and
    codec bos; its step inputs are the thinker's states, passed on as their handle."""
    thinker = upstream["thinker"]
    if "hidden_states" not in thinker.tensor_handles:
        raise ValueError("the thinker stage must keep hidden states (hidden_states: true)")
    config = stage.model_config.hf_config
    prompt_ids = list(thinker.prompt_token_ids)
    codec = [config.tts_codec_mask_token_id] * len(prompt_ids)
    codec += [config.tts_codec_pad_token_id, config.tts_codec_start_token_id]
    return {
        "prompt_token_ids": codec,
        "step_inputs": {
            "tensors": thinker.tensor_handles["hidden_states"],
            "args": {
                "thinker_prompt": prompt_ids,
                "text_bos": speaker_bos(stage.model_config.model, None),
            },
        },
    }
