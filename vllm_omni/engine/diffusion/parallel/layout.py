"""The ranks of a parallel diffusion stage and the checks made before any engine starts.

A stage's world is `cfg_parallel_size x ring_degree x ulysses_degree` ranks. Global rank
`g = c * (ring * ulysses) + i * ulysses + j`: `c` is its guidance branch group (CFG
parallel), and inside that group the sequence-parallel ranks form a ring_degree x
ulysses_degree grid (Ulysses groups are the rows, ring groups the columns). Rank 0 is the
engine core's own process.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Pipelines whose step adapter can split its sequence over ranks (our attention processor
# knows their attention), and those whose guidance branches can go to two ranks (Wan's
# step adapter, newer than this list, is not yet proven there).
SEQUENCE_PARALLEL = {"FluxPipeline"}
CFG_PARALLEL = {"FluxPipeline", "StableDiffusion3Pipeline", "QwenImagePipeline"}
OPTIONS = ("ulysses_degree", "ring_degree", "cfg_parallel_size")


@dataclass(frozen=True)
class Layout:
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1

    @classmethod
    def of(cls, options: Any) -> Layout:
        return cls(options.ulysses_degree, options.ring_degree, options.cfg_parallel_size)

    @property
    def sequence(self) -> int:
        return self.ulysses * self.ring

    @property
    def world(self) -> int:
        return self.cfg * self.sequence

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(cfg group, ring index, ulysses index) of a global rank."""
        c, rest = divmod(rank, self.sequence)
        i, j = divmod(rest, self.ulysses)
        return c, i, j

    def rank(self, c: int, i: int, j: int) -> int:
        return c * self.sequence + i * self.ulysses + j

    def sequence_ranks(self, c: int) -> list[int]:
        return [c * self.sequence + k for k in range(self.sequence)]

    def ulysses_ranks(self, c: int, i: int) -> list[int]:
        return [self.rank(c, i, j) for j in range(self.ulysses)]

    def ring_ranks(self, c: int, j: int) -> list[int]:
        return [self.rank(c, i, j) for i in range(self.ring)]


def check_degrees(options: Any) -> None:
    """ValueError for a degree that is not a positive integer (or a CFG size other than 2)."""
    for name in OPTIONS:
        value = getattr(options, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if options.cfg_parallel_size > 2:
        raise ValueError(f"cfg_parallel_size is 1 or 2 (one rank per guidance branch), "
                         f"got {options.cfg_parallel_size}")


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def text_tokens(root: Path, pipeline: str) -> int | None:
    """The text length Flux pads every prompt to (its T5 tokenizer's, at most 512)."""
    if pipeline != "FluxPipeline":
        return None
    given = _read(root / "tokenizer_2" / "tokenizer_config.json").get("model_max_length")
    return min(int(given), 512) if isinstance(given, int | float) else 512


def default_image_tokens(root: Path) -> int | None:
    """Flux's packed latent tokens at the model's default size (as the adapter reads it)."""
    vae = _read(root / "vae" / "config.json")
    dit = _read(root / "transformer" / "config.json")
    scale = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
    size = vae.get("sample_size")
    if not isinstance(size, int):
        size = dit.get("sample_size", 128) * scale
    side = size // (scale * 2)
    return side * side


def parallel_problems(name: str, options: Any, model: str, device: str,
                      cores: list[int]) -> list[str]:
    """What keeps a diffusion stage from running with its degrees, as sentences naming the
    stage, the option and the numbers."""
    layout = Layout.of(options)
    if layout.world == 1:
        return []
    stage, problems = repr(name), []
    root = Path(model)
    pipeline = _read(root / "model_index.json").get("_class_name", "?")
    dit = _read(root / "transformer" / "config.json")
    if layout.cfg > 1 and pipeline not in CFG_PARALLEL:
        problems.append(f"stage {stage}: cfg_parallel_size {layout.cfg}: {pipeline} has no "
                        f"CFG-parallel support (supported: {sorted(CFG_PARALLEL)})")
    for option, degree in (("ulysses_degree", layout.ulysses), ("ring_degree", layout.ring)):
        if degree > 1 and pipeline not in SEQUENCE_PARALLEL:
            problems.append(f"stage {stage}: {option} {degree}: {pipeline} has no "
                            f"sequence-parallel support (supported: {sorted(SEQUENCE_PARALLEL)}"
                            f"; use cfg_parallel_size)")
    if layout.sequence > 1 and pipeline in SEQUENCE_PARALLEL:
        heads = dit.get("num_attention_heads")
        if heads and heads % layout.ulysses:
            problems.append(f"stage {stage}: ulysses_degree {layout.ulysses} does not divide "
                            f"the model's {heads} attention heads")
        text = text_tokens(root, pipeline)
        if text and text % layout.sequence:
            problems.append(f"stage {stage}: ulysses_degree x ring_degree = {layout.sequence} "
                            f"does not divide the model's {text} text tokens")
        image = default_image_tokens(root)
        if image and image % layout.sequence:
            problems.append(f"stage {stage}: ulysses_degree x ring_degree = {layout.sequence} "
                            f"does not divide the {image} image tokens of the default size")
    world = f"{layout.cfg} x {layout.ring} x {layout.ulysses}"
    if device == "cpu":
        if len(cores) < layout.world:
            problems.append(f"stage {stage}: cfg_parallel_size x ring_degree x ulysses_degree "
                            f"= {world} needs {layout.world} cores, one per rank; "
                            f"{len(cores)} available: {cores}")
    else:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        first = int(device.split(":")[1]) if ":" in device else 0
        if first + layout.world > count:
            problems.append(f"stage {stage}: cfg_parallel_size x ring_degree x ulysses_degree "
                            f"= {world} needs GPUs {first}..{first + layout.world - 1}, one "
                            f"per rank; {count} visible")
    return problems


def rank_devices(device: str, world: int) -> list[str]:
    """Each rank's device: the stage's device for all on CPU, consecutive GPUs from it."""
    if device == "cpu":
        return ["cpu"] * world
    first = int(device.split(":")[1]) if ":" in device else 0
    return [f"cuda:{first + r}" for r in range(world)]


def rank_cores(cores: list[int] | None, world: int) -> list[list[int]]:
    """The CPU cores of each rank: the given ones (else this process' own) split evenly."""
    cores = sorted(cores or os.sched_getaffinity(0))
    per = max(1, len(cores) // world)
    return [cores[r * per:(r + 1) * per] or cores[-1:] for r in range(world)]
