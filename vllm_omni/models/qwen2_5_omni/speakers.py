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
    """The voices, each `cond` as [D] and `ref_mel` as [1, T, mels]: checkpoints store them
    with or without the leading batch dimension, and HF's generate takes either. A malformed
    entry fails here (at start-up), naming the file and the speaker."""
    import torch

    path = Path(folder) / SPEAKERS_FILE
    table = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{path}: expected a dict of speakers, got {type(table).__name__}")
    return {name: _speaker(path, name, entry) for name, entry in table.items()}


def _speaker(path: Path, name: str, entry: Any) -> dict[str, Any]:
    import torch

    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: speaker {name!r}: {what}")

    if not isinstance(entry, dict) or not {"bos_token", "cond", "ref_mel"} <= set(entry):
        raise bad("needs bos_token, cond and ref_mel")
    cond, mel = entry["cond"], entry["ref_mel"]
    if not isinstance(cond, torch.Tensor) or not isinstance(mel, torch.Tensor):
        raise bad("cond and ref_mel must be tensors")
    if cond.dim() == 2 and cond.shape[0] == 1:
        cond = cond[0]
    if cond.dim() != 1:
        raise bad(f"cond must be [D] or [1, D], got {list(entry['cond'].shape)}")
    if mel.dim() == 2:
        mel = mel[None]
    if mel.dim() != 3 or mel.shape[0] != 1:
        raise bad(f"ref_mel must be [T, mels] or [1, T, mels], got {list(entry['ref_mel'].shape)}")
    return {**entry, "cond": cond, "ref_mel": mel}


def default_speaker(names: list[str]) -> str:
    return DEFAULT_SPEAKER if DEFAULT_SPEAKER in names else names[0]


def speaker_bos(folder: str, speaker: str | None) -> int:
    table = speakers(folder)
    name = speaker or default_speaker(list(table))
    if name not in table:
        raise ValueError(f"unknown voice {name!r}; this model has {sorted(table)}")
    return int(table[name]["bos_token"])
