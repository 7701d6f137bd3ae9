"""The code2wav engine core: a loop in its own process that turns codec tokens into audio.

It runs HF transformers' Qwen2.5-Omni token2wav (flow-matching DiT, then the BigVGAN
vocoder), loaded alone from the model folder's `token2wav.*` weights. Requests run one at a
time in arrival order: the DiT draws its starting noise inside its sampling call, so a
request's waveform equals HF's for its seed only when decoded on its own (as HF does too).
Messages are read between requests, so an abort drops a waiting request at once and a
running one right after its decode.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

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


def check_params(params: dict[str, Any], speakers: list[str]) -> None:
    unknown = sorted(set(params) - PARAMS)
    if unknown:
        raise ValueError(f"unknown code2wav parameters {unknown}; known: {sorted(PARAMS)}")
    if params.get("speaker") is not None and params["speaker"] not in speakers:
        raise ValueError(f"unknown voice {params['speaker']!r}; this model has {speakers}")
    if "num_steps" in params and not (isinstance(params["num_steps"], int)
                                      and params["num_steps"] >= 1):
        raise ValueError("num_steps must be an integer >= 1")


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

    def decode(self, codes: list[int], params: dict[str, Any]) -> tuple[np.ndarray, int]:
        import torch

        speaker = self.speakers[params.get("speaker") or default_speaker(list(self.speakers))]
        seed = params.get("seed")
        seed = secrets.randbits(63) if seed is None else int(seed)
        torch.manual_seed(seed)  # the DiT draws its noise from the global generator
        wave = self.token2wav(
            torch.tensor([codes], device=self.device),
            conditioning=speaker["cond"].to(self.device, self.dtype)[None],
            reference_mel=speaker["ref_mel"].to(self.device, self.dtype),
            num_steps=params["num_steps"],
            guidance_scale=params["guidance_scale"],
            sway_coefficient=params["sway_coefficient"],
        )
        return wave.reshape(-1).float().cpu().numpy(), seed

    def run(self) -> None:
        import torch

        with torch.inference_mode():
            while self.running:
                if not self.waiting:
                    self.conn.poll(None)
                while self.running and self.conn.poll(0):
                    self.handle(self.conn.recv())
                if self.running and self.waiting:
                    request_id, (codes, params) = self.waiting.popitem(last=False)
                    try:
                        wave, seed = self.decode(codes, params)
                    except Exception as e:
                        logger.error("code2wav request %s failed:\n%s", request_id,
                                     traceback.format_exc())
                        self.conn.send(Code2WavOutput(request_id, True, error=repr(e),
                                                      error_kind="internal"))
                        continue
                    self.conn.send(Code2WavOutput(request_id, True, wave, self.sample_rate,
                                                  seed))


def run_code2wav_core(model: str, options: Code2WavOptions, conn: Connection) -> None:
    """Process entry point: load, report ready (or why not), serve until shutdown or EOF."""
    logging.basicConfig(level=logging.INFO, format=f"(Code2WavCore pid={os.getpid()}) %(message)s")
    try:
        core = Code2WavCore(model, options, conn)
    except BaseException:
        conn.send(("start_failed", traceback.format_exc()))
        return
    conn.send(("ready", core.info()))
    try:
        core.run()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
