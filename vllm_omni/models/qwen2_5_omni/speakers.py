"""Qwen2.5-Omni's voices: `spk_dict.pt` in the model folder holds, per speaker, the talker's
text bos token, and the vocoder DiT's speaker embedding (`cond`) and reference mel."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

SPEAKERS_FILE = "spk_dict.pt"
DEFAULT_SPEAKER = "Chelsie"  # HF's default voice


@cache
def speakers(folder: str) -> dict[str, dict[str, Any]]:
    import torch

    return torch.load(Path(folder) / SPEAKERS_FILE, map_location="cpu", weights_only=True)


def default_speaker(names: list[str]) -> str:
    return DEFAULT_SPEAKER if DEFAULT_SPEAKER in names else names[0]


def speaker_bos(folder: str, speaker: str | None) -> int:
    table = speakers(folder)
    name = speaker or default_speaker(list(table))
    if name not in table:
        raise ValueError(f"unknown voice {name!r}; this model has {sorted(table)}")
    return int(table[name]["bos_token"])
