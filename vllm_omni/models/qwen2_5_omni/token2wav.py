"""Qwen2.5-Omni's token2wav (flow-matching DiT, then the BigVGAN vocoder), loaded alone from
the model folder: HF transformers' modules with only their own `token2wav.*` weights read."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

CODEC_HZ = 50  # the talker emits 50 codes per second of speech


class RememberedSpeakerEncoder(torch.nn.Module):
    """The DiT's speaker encoder, computed once per batch instead of once per evaluation.

    HF's DiT encodes the reference mel at every call, and the flow solver calls it 36 times
    per batch with the same reference mels (a third of a small window's DiT time on the
    tiny model). It returns the last result while its input is unchanged."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        last = self._last
        if last is not None and last[0].shape == mel.shape and torch.equal(last[0], mel):
            return last[1]
        out = self.encoder(mel)
        self._last = (mel, out)
        return out


def load_token2wav(folder: str, dtype: str, device: str) -> tuple[Any, int]:
    """HF's token2wav module and its output sample rate."""
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniToken2WavModel,
    )

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



def compile_token2wav(model: Any) -> None:
    """The DiT and the vocoder through torch.compile (inductor), with dynamic shapes. Compiling
    takes a while (minutes on a CPU for the 7B's depth), paid by the first decode; Dynamo
    still compiles again for some new lengths and batch sizes."""
    model.code2wav_dit_model = torch.compile(model.code2wav_dit_model, dynamic=True)
    model.code2wav_bigvgan_model = torch.compile(model.code2wav_bigvgan_model, dynamic=True)
