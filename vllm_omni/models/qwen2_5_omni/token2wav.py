"""Qwen2.5-Omni's token2wav (flow-matching DiT, then the BigVGAN vocoder), loaded alone from
the model folder: HF transformers' modules with only their own `token2wav.*` weights read."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

CODEC_HZ = 50  # the talker emits 50 codes per second of speech


def load_token2wav(folder: str, dtype: str, device: str) -> tuple[Any, int]:
    """HF's token2wav module and its output sample rate."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniToken2WavModel,
    )

    from vllm_omni.engine.code2wav.sampler import RememberedSpeakerEncoder

    config = AutoConfig.from_pretrained(folder).token2wav_config
    model = Qwen2_5OmniToken2WavModel._from_config(config)
    index = Path(folder) / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"])
    state = {}
    for name in files:
        with safe_open(str(Path(folder) / name), "pt") as f:
            for key in f.keys():
                if key.startswith("token2wav."):
                    state[key.removeprefix("token2wav.")] = f.get_tensor(key)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "inv_freq" not in k]  # buffers HF computes itself
    if missing or unexpected:
        raise ValueError(f"token2wav weights do not fit: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    embed = model.code2wav_dit_model.input_embed
    embed.spk_encoder = RememberedSpeakerEncoder(embed.spk_encoder)
    rate = CODEC_HZ * config.dit_config.repeats * math.prod(config.bigvgan_config.upsample_rates)
    return model, rate
