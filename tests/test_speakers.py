"""Qwen2.5-Omni voices stored in every shape HF accepts speak the same; a malformed voice
table fails at start-up, naming the file and the speaker."""

from __future__ import annotations

import multiprocessing
import shutil

import numpy as np
import pytest
import torch

from vllm_omni.models.qwen2_5_omni.speakers import SPEAKERS_FILE, speakers


@pytest.fixture(scope="module")
def reshaped(tiny_omni, tmp_path_factory):
    """A copy of the tiny Qwen2.5-Omni whose voices store cond as [1, D], ref_mel as [T, 80]."""
    folder = tmp_path_factory.mktemp("reshaped") / "omni"
    shutil.copytree(tiny_omni, folder)
    table = torch.load(folder / SPEAKERS_FILE, weights_only=True)
    for entry in table.values():
        entry["cond"] = entry["cond"].reshape(1, -1)
        entry["ref_mel"] = entry["ref_mel"].reshape(-1, entry["ref_mel"].shape[-1])
    torch.save(table, folder / SPEAKERS_FILE)
    return str(folder)


def decode(folder: str, codes: list[int], speaker: str) -> np.ndarray:
    """One request through the code2wav engine core, in this process."""
    from vllm_omni.engine.code2wav.core import Code2WavCore, Code2WavOptions
    from vllm_omni.engine.runtime import AddRequest

    ours, theirs = multiprocessing.Pipe()
    core = Code2WavCore(folder, Code2WavOptions(num_threads=1), theirs)
    core.handle(AddRequest("r", {"codes": codes, "complete": True},
                           {"seed": 3, "speaker": speaker}))
    with torch.inference_mode():  # as the core's own process runs it
        while core.has_work:
            core.step()
    out = ours.recv()
    assert out.error is None and out.finished
    return out.waveform


def test_every_shape_hf_takes_speaks_the_same(tiny_omni, reshaped):
    original, other = speakers(tiny_omni), speakers(reshaped)
    assert original.keys() == other.keys()
    for name in original:
        assert torch.equal(original[name]["cond"], other[name]["cond"])
        assert torch.equal(original[name]["ref_mel"], other[name]["ref_mel"])
    codes = list(range(3, 3 + 40))
    for name in original:
        assert np.array_equal(decode(tiny_omni, codes, name), decode(reshaped, codes, name))


def test_a_malformed_voice_is_named(tiny_omni, tmp_path):
    table = torch.load(f"{tiny_omni}/{SPEAKERS_FILE}", weights_only=True)
    name = next(iter(table))
    table[name]["cond"] = torch.zeros(2, 8)
    torch.save(table, tmp_path / SPEAKERS_FILE)
    with pytest.raises(ValueError, match=rf"spk_dict.pt: speaker '{name}': cond must be"):
        speakers(str(tmp_path))
    table[name]["cond"] = torch.zeros(8)
    del table[name]["ref_mel"]
    (tmp_path / "b").mkdir()
    torch.save(table, tmp_path / "b" / SPEAKERS_FILE)
    with pytest.raises(ValueError, match=rf"speaker '{name}': needs bos_token, cond and ref_mel"):
        speakers(str(tmp_path / "b"))
