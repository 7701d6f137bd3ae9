"""The code2wav engine core: a loop in its own process that turns codec tokens into audio.

It runs HF transformers' Qwen2.5-Omni token2wav modules (flow-matching DiT, then the BigVGAN
vocoder), loaded alone from the model folder's `token2wav.*` weights, with our sampler
(sampler.py): the waiting requests with the same code length, voice and solver settings are
decoded as one batch (up to `max_batch_size`), each from its own seed's noise, so a request's
waveform equals HF's for its seed whatever it is batched with. Oldest request first; messages
are read between batches, so an abort drops a waiting request at once and a running one
right after its batch.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from vllm_omni.engine.core_process import serve_core
from vllm_omni.models.qwen2_5_omni.speakers import default_speaker, speakers

logger = logging.getLogger(__name__)

CODEC_HZ = 50  # Qwen2.5-Omni's talker emits 50 codes per second of speech
PARAMS = {"seed", "speaker", "num_steps", "guidance_scale", "sway_coefficient"}
HF_DEFAULTS = {"num_steps": 10, "guidance_scale": 0.5, "sway_coefficient": -1.0}


@dataclass
class Code2WavOptions:
    dtype: str = "float32"  # HF runs token2wav in float32 whatever the rest of the model
    device: str = "cpu"
    num_threads: int | None = None
    max_batch_size: int = 8
    defaults: dict[str, Any] = field(default_factory=dict)


@dataclass
class Code2WavOutput:
    request_id: str
    finished: bool = False
    waveform: np.ndarray | None = None
    sample_rate: int = 0
    seed: int | None = None
    error: str | None = None
    error_kind: str | None = None  # "invalid" (the request's fault) or "internal"
    latents: Any = None  # part of the engine-client protocol; code2wav sends none


def check_params(params: dict[str, Any], speakers: list[str] | None) -> None:
    """Raise ValueError naming what is wrong; `speakers` None: voices not known yet."""
    unknown = sorted(set(params) - PARAMS)
    if unknown:
        raise ValueError(f"unknown code2wav parameters {unknown}; known: {sorted(PARAMS)}")
    voice = params.get("speaker")
    if speakers is not None and voice is not None and voice not in speakers:
        raise ValueError(f"unknown voice {voice!r}; this model has {speakers}")
    if "num_steps" in params and not (isinstance(params["num_steps"], int)
                                      and params["num_steps"] >= 2):
        raise ValueError("num_steps must be an integer >= 2")
    seed = params.get("seed")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**63):
        raise ValueError("seed must be an integer in [0, 2**63)")


def load_token2wav(folder: str, dtype: str, device: str):
    """HF's token2wav module with only its own weights read from the folder."""
    import torch
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
    rate = CODEC_HZ * config.dit_config.repeats * math.prod(config.bigvgan_config.upsample_rates)
    return model, rate


class Code2WavCore:
    def __init__(self, model: str, options: Code2WavOptions, conn: Connection) -> None:
        import torch

        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        self.conn = conn
        self.device = options.device
        self.defaults = {**HF_DEFAULTS, **options.defaults}
        self.token2wav, self.sample_rate = load_token2wav(model, options.dtype, options.device)
        self.dtype = getattr(torch, options.dtype)
        self.speakers = speakers(model)
        check_params(options.defaults, list(self.speakers))
        self.max_batch_size = options.max_batch_size
        self.waiting: OrderedDict[str, tuple[list[int], dict[str, Any]]] = OrderedDict()
        self.running = True

    def info(self) -> dict[str, Any]:
        return {"sample_rate": self.sample_rate, "speakers": list(self.speakers),
                "defaults": self.defaults}

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            request_id, codes, params = msg[1], msg[2], msg[3]
            try:
                check_params(params, list(self.speakers))
                if not codes:
                    raise ValueError("no codec tokens to decode")
            except ValueError as e:
                self.conn.send(Code2WavOutput(request_id, True, error=str(e),
                                              error_kind="invalid"))
                return
            self.waiting[request_id] = (list(codes), {**self.defaults, **params})
        elif kind == "abort":
            self.waiting.pop(msg[1], None)
        elif kind == "shutdown":
            self.running = False

    def batch_key(self, codes: list[int], params: dict[str, Any]) -> tuple:
        speaker = params.get("speaker") or default_speaker(list(self.speakers))
        return (len(codes), speaker, params["num_steps"], params["guidance_scale"],
                params["sway_coefficient"])

    def next_batch(self) -> list[tuple[str, list[int], dict[str, Any]]]:
        """The oldest waiting request and the waiting ones it can share a DiT call with."""
        first_id, (codes, params) = next(iter(self.waiting.items()))
        key = self.batch_key(codes, params)
        batch = [(rid, c, p) for rid, (c, p) in self.waiting.items()
                 if self.batch_key(c, p) == key][: self.max_batch_size]
        for rid, _, _ in batch:
            del self.waiting[rid]
        return batch

    def decode(self, batch: list[tuple[str, list[int], dict[str, Any]]]) -> list[np.ndarray]:
        import torch

        from vllm_omni.engine.code2wav.sampler import sample_mels

        _, codes, params = batch[0]
        length, speaker_name, num_steps, guidance, sway = self.batch_key(codes, params)
        speaker = self.speakers[speaker_name]
        n = len(batch)
        mels = sample_mels(
            self.token2wav.code2wav_dit_model,
            torch.tensor([c for _, c, _ in batch], device=self.device),
            speaker["cond"].to(self.device, self.dtype)[None].expand(n, -1),
            speaker["ref_mel"].to(self.device, self.dtype).expand(n, -1, -1),
            [p["seed"] for _, _, p in batch], num_steps, guidance, sway,
        )
        waves = self.token2wav.code2wav_bigvgan_model(mels).reshape(n, -1)
        return list(waves.float().cpu().numpy())

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    def step(self) -> None:
        if not self.waiting:
            return
        batch = self.next_batch()
        for _, _, params in batch:
            if params.get("seed") is None:
                params["seed"] = secrets.randbits(63)
        try:
            waves = self.decode(batch)
        except Exception as e:
            logger.error("code2wav requests %s failed:\n%s", [r for r, _, _ in batch],
                         traceback.format_exc())
            for request_id, _, _ in batch:
                self.conn.send(Code2WavOutput(request_id, True, error=repr(e),
                                              error_kind="internal"))
            return
        for (request_id, _, params), wave in zip(batch, waves, strict=True):
            self.conn.send(Code2WavOutput(request_id, True, wave, self.sample_rate,
                                          int(params["seed"])))


def run_code2wav_core(model: str, options: Code2WavOptions, conn: Connection) -> None:
    serve_core(lambda: Code2WavCore(model, options, conn), conn, "Code2WavCore")
