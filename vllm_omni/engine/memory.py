"""What a stage will hold in memory, as its kind estimates it from the model's files before
any engine starts (`StageKind.memory_needs` returns a `StagePlan`); the pipeline's plan,
which gives each stage its budget, is orchestrator/memory.py's."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

from vllm_omni.config.placement import GIB

# The engine processes' own memory (libraries, allocator pools, a CUDA context), by engine
# ("ar": vLLM's core and worker; "other": one of our cores) and device type; measured.
RUNTIME = {("ar", "cpu"): 1.5 * GIB, ("ar", "cuda"): 1.0 * GIB,
           ("other", "cpu"): 0.6 * GIB, ("other", "cuda"): 0.75 * GIB}
# Each further rank of an AR stage is one more vLLM worker process (on GPUs: its CUDA
# context on its own device); measured with TP=2 on CPU.
AR_RANK_RUNTIME = {"cpu": 0.9 * GIB, "cuda": 1.0 * GIB}
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
                "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
TORCH_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


@dataclasses.dataclass
class StagePlan:
    """One stage's memory, in bytes, all its ranks together. `source` says who set the
    budget. A stage with several ranks (AR tensor / pipeline parallel) holds 1/ranks of each
    figure per rank; its ranks sit on `rank_devices` (all on "cpu", or one GPU each)."""

    stage: str
    engine: str
    device: str
    weights: int
    kv_cache: int
    activations: int
    runtime: int
    source: str = "planned"
    # Settings handed to the engine (vLLM engine args for AR stages).
    engine_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    # AR stages: the KV cache the stage would like and the least it can run with.
    kv_wanted: int = 0
    kv_floor: int = 0
    ranks: int = 1
    rank_devices: list[str] = dataclasses.field(default_factory=list)  # default: [device]
    # Environment the engine starts with (None: unset), e.g. its CPU thread binding.
    env: dict[str, str | None] = dataclasses.field(default_factory=dict)
    # What keeps the stage from starting as configured, as sentences naming it.
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.runtime

    @property
    def devices(self) -> list[str]:
        return self.rank_devices or [self.device]

    def share(self, device: str) -> float:
        """The fraction of the stage that lives on `device`."""
        return self.devices.count(device) / len(self.devices)



# -- weights ------------------------------------------------------------------------------


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def weights_bytes(model: str, prefix: str | None = None, itemsize: int | None = None) -> int:
    """Bytes the weights under a model folder take in memory: safetensors tensors (only those
    whose names start with `prefix`, when given), floating ones at `itemsize` bytes per value
    when given; other weight files by their size. 0 for a name that is not a local folder."""
    folder = Path(model)
    if not folder.is_dir():
        return 0
    total = 0
    for f in sorted(folder.rglob("*")):
        if f.suffix == ".safetensors":
            for name, info in _safetensors_header(f).items():
                if name == "__metadata__" or (prefix and not name.startswith(prefix)):
                    continue
                count = 1
                for dim in info["shape"]:
                    count *= dim
                size = _DTYPE_BYTES.get(info["dtype"], 1)
                floating = info["dtype"].startswith(("F", "BF"))
                total += count * (itemsize if itemsize and floating else size)
        elif f.suffix in {".bin", ".pt", ".pth"} and f.name != "spk_dict.pt" and not prefix:
            total += f.stat().st_size
    return total


def read_config(path: Path) -> dict[str, Any]:
    """A JSON config file's contents ({} when it is missing)."""
    return json.loads(path.read_text()) if path.is_file() else {}
