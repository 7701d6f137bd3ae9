"""The tiny model factory: deterministic HF folders that the normal loaders read."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    from vllm_omni.testing.tiny_models import make_tiny

    a = digest(make_tiny("qwen2-tiny", tmp_path / "a", seed=3))
    b = digest(make_tiny("qwen2-tiny", tmp_path / "b", seed=3))
    c = digest(make_tiny("qwen2-tiny", tmp_path / "c", seed=4))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loads_with_transformers_and_chats(tmp_path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_omni.testing.tiny_models import make_tiny

    folder = make_tiny("qwen2-tiny", tmp_path / dtype, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == getattr(torch, dtype)
    assert model.config.architectures == ["Qwen2ForCausalLM"]
    assert model.config.vocab_size == len(tok)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello world"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE round-trips any text
    assert tok.decode(tok("naïve 🙂 text")["input_ids"]) == "naïve 🙂 text"
    assert tok.eos_token == "<|im_end|>"
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(ids) + 4) or tok.eos_token_id in out[0, len(ids) :].tolist()


def test_cli_make_tiny(tmp_path):
    vllm_omni = Path(sys.executable).parent / "vllm-omni"
    out = tmp_path / "cli-model"
    subprocess.run(
        [str(vllm_omni), "make-tiny", "qwen2-tiny", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_unknown_name_is_an_error(tmp_path):
    from vllm_omni.testing.tiny_models import make_tiny

    with pytest.raises(ValueError, match="unknown tiny model"):
        make_tiny("gpt-17", tmp_path / "x")
