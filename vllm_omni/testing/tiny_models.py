"""Tiny models with random weights, built from the real architectures' configs.

Each builder writes an HF-format folder (config, safetensors, tokenizer, chat template,
generation config) that the normal loading code (vLLM, transformers) reads as if it were
downloaded. Same name + seed + dtype gives the same files.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_omni.testing.tiny_diffusers import DIFFUSERS_MODELS
from vllm_omni.testing.tiny_omni import build_qwen2_5_omni
from vllm_omni.testing.tiny_qwen3_omni import build_qwen3_omni
from vllm_omni.testing.tokenizer import CHATML_TEMPLATE, train_tokenizer

CHAT_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class Qwen2Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int


QWEN2_SIZES = {
    # Overhead-dominated: tests and the demo default.
    "qwen2-tiny": Qwen2Size(128, 2, 4, 2, 256, 1024, 4096),
    # Compute shows on a CPU: benchmarks.
    "qwen2-small": Qwen2Size(512, 6, 8, 4, 1536, 4096, 4096),
}


def build_qwen2(out_dir: Path, size: Qwen2Size, seed: int, dtype: str) -> None:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = train_tokenizer(size.vocab, CHAT_SPECIAL_TOKENS, seed=seed)
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.chat_template = CHATML_TEMPLATE
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=size.max_positions,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype=dtype,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _qwen2_builder(size: Qwen2Size) -> Callable[[Path, int, str], None]:
    return lambda out_dir, seed, dtype: build_qwen2(out_dir, size, seed, dtype)


def _diffusers_builder(name: str) -> Callable[[Path, int, str], None]:
    def build(out_dir: Path, seed: int, dtype: str) -> None:
        from vllm_omni.testing.tiny_diffusers import build_diffusers

        build_diffusers(name, out_dir, seed, dtype)

    return build


BUILDERS: dict[str, Callable[[Path, int, str], None]] = {
    **{name: _qwen2_builder(size) for name, size in QWEN2_SIZES.items()},
    **{name: _diffusers_builder(name) for name in DIFFUSERS_MODELS},
    "qwen2_5-omni-tiny": build_qwen2_5_omni,
    "qwen2_5-omni-small": functools.partial(build_qwen2_5_omni, size="small"),
    "qwen2_5-omni-scaled": functools.partial(build_qwen2_5_omni, size="scaled"),
    "qwen3-omni-tiny": build_qwen3_omni,
}


def make_tiny(name: str, out_dir: str | os.PathLike, seed: int = 0, dtype: str = "float32") -> Path:
    """Build the tiny model `name` into `out_dir` (replaced if it exists)."""
    if name not in BUILDERS:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {sorted(BUILDERS)}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, not {dtype!r}")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a reader never sees a half-written folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        BUILDERS[name](tmp, seed, dtype)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def cache_dir() -> Path:
    root = os.environ.get("VLLM_OMNI_CACHE_DIR") or Path.home() / ".cache" / "vllm-omni"
    return Path(root) / "models"


@functools.cache
def recipe_id() -> str:
    """A short hash of the factory's code (this package's tiny_*.py and tokenizer.py): a
    changed recipe gets new cache entries, so a cache never serves a model an older
    factory built."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        if path.name.startswith("tiny_") or path.name == "tokenizer.py":
            digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


def get_or_make(name: str, seed: int = 0, dtype: str = "float32") -> Path:
    """The cached folder of a tiny model, built on first use (safe across processes)."""
    if name not in BUILDERS:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {sorted(BUILDERS)}")
    out = cache_dir() / f"{name}-{dtype}-seed{seed}-{recipe_id()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # HF models have config.json, diffusers pipelines model_index.json.
        if not any((out / f).exists() for f in ("config.json", "model_index.json")):
            make_tiny(name, out, seed=seed, dtype=dtype)
    return out


DEFAULT_MODEL = "qwen2-tiny"
