"""The code2wav engine core: a loop in its own process that turns codec tokens into audio.

It runs HF transformers' Qwen2.5-Omni token2wav modules (flow-matching DiT, then the BigVGAN
vocoder), loaded alone from the model folder's `token2wav.*` weights, with our sampler
(sampler.py). A request is decoded whole (HF's result) or, streamed, chunk by chunk as its
codes arrive (chunks.py). Ready work with the same DiT window length, voice and solver
settings is decoded as one batch (up to `max_batch_size` and `max_batch_frames`), each from
its own seed's noise, so a request's waveform does not depend on what it is batched with:
decoded whole it equals HF's for its seed. Oldest request first; messages are read between
batches, so an abort drops a request at once or right after its batch.
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

from vllm_omni.engine.code2wav.chunks import (
    ChunkSettings,
    Code2WavRequest,
    Job,
    next_job,
    vocoder_input,
    window_noise,
)
from vllm_omni.engine.core_process import serve_core
from vllm_omni.models.qwen2_5_omni.speakers import default_speaker, speakers

logger = logging.getLogger(__name__)

CODEC_HZ = 50  # Qwen2.5-Omni's talker emits 50 codes per second of speech
PARAMS = {"seed", "speaker", "num_steps", "guidance_scale", "sway_coefficient", "stream"}
HF_DEFAULTS = {"num_steps": 10, "guidance_scale": 0.5, "sway_coefficient": -1.0}


@dataclass
class Code2WavOptions:
    dtype: str = "float32"  # HF runs token2wav in float32 whatever the rest of the model
    device: str = "cpu"
    # None on CPU: half the cores. Code2wav runs beside the talker (streamed audio overlaps
    # them), whose vLLM worker binds its own cores; with all cores the two contend (on 2
    # cores, streamed time to first audio 1.22 s with 2 threads, 0.63 s with 1).
    num_threads: int | None = None
    max_batch_size: int = 8
    # Mel frames per DiT batch and per vocoder batch (at least one request). Past about a
    # thousand frames the activations leave a CPU's caches and a batch costs more per request
    # than one by one (tiny model, 1 thread: 8 x 300 codes batched 2.4 s/request, alone 1.4 s);
    # a GPU wants far more.
    max_batch_frames: int = 1024
    defaults: dict[str, Any] = field(default_factory=dict)
    # Streamed requests (see chunks.py): audio per `chunk_codes` codes (0.48 s at 50 codes/s),
    # each denoised with this many codes of context before it and after it, and voiced with
    # this many mel frames around it.
    chunk_codes: int = 24
    first_chunk_codes: int = 12  # the first audio sooner: it waits for 12 + 12 codes, not 36
    context_codes: int = 24
    lookahead_codes: int = 12
    vocoder_context_frames: int = 24


@dataclass
class Code2WavOutput:
    request_id: str
    finished: bool = False
    waveform: np.ndarray | None = None
    sample_rate: int = 0
    seed: int | None = None
    input_complete: bool = True  # whether all codes had arrived when this audio was made
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
    if not isinstance(params.get("stream", False), bool):
        raise ValueError("stream must be true or false")
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

    from vllm_omni.engine.code2wav.sampler import RememberedSpeakerEncoder

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


class Code2WavCore:
    def __init__(self, model: str, options: Code2WavOptions, conn: Connection) -> None:
        import torch

        threads = options.num_threads
        if threads is None and options.device == "cpu":
            threads = max(1, (os.cpu_count() or 2) // 2)
        if threads:
            torch.set_num_threads(threads)
        self.conn = conn
        self.device = options.device
        self.defaults = {**HF_DEFAULTS, **options.defaults}
        self.token2wav, self.sample_rate = load_token2wav(model, options.dtype, options.device)
        self.dtype = getattr(torch, options.dtype)
        dit = self.token2wav.code2wav_dit_model
        self.chunking = ChunkSettings(
            options.chunk_codes, options.context_codes, options.lookahead_codes,
            options.vocoder_context_frames, dit.repeats, dit.mel_dim, options.first_chunk_codes,
        )
        self.chunking.check(dit.block_size // dit.repeats)
        self.speakers = speakers(model)
        check_params(options.defaults, list(self.speakers))
        self.max_batch_size = options.max_batch_size
        self.max_batch_frames = options.max_batch_frames
        self.requests: OrderedDict[str, Code2WavRequest] = OrderedDict()  # oldest first
        self.running = True

    def info(self) -> dict[str, Any]:
        return {"sample_rate": self.sample_rate, "speakers": list(self.speakers),
                "defaults": self.defaults, "chunk_codes": self.chunking.chunk_codes,
                "first_chunk_codes": self.chunking.first_chunk}

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":  # ("add", id, {"codes": [...], "complete": bool}, params, images)
            request_id, prompt, params = msg[1], msg[2], msg[3]
            try:
                check_params(params, list(self.speakers))
            except ValueError as e:
                self.fail([request_id], str(e), "invalid")
                return
            params = {**self.defaults, **params}
            if params.get("seed") is None:
                params["seed"] = secrets.randbits(63)
            self.requests[request_id] = Code2WavRequest(
                request_id, list(prompt["codes"]), params, prompt.get("complete", True))
            self.check_not_empty(request_id)
        elif kind == "extend":  # ("extend", id, more codes, complete): streamed input
            request = self.requests.get(msg[1])
            if request is not None:  # else aborted or failed already
                request.codes += msg[2]
                request.complete = msg[3]
                self.check_not_empty(msg[1])
        elif kind == "abort":
            self.requests.pop(msg[1], None)
        elif kind == "shutdown":
            self.running = False

    def check_not_empty(self, request_id: str) -> None:
        request = self.requests[request_id]
        if request.complete and not request.codes:
            self.fail([request_id], "no codec tokens to decode", "invalid")

    def fail(self, request_ids: list[str], error: str, kind: str) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)
            self.conn.send(Code2WavOutput(request_id, True, error=error, error_kind=kind))

    def batch_key(self, job: Job) -> tuple:
        params = job.request.params
        speaker = params.get("speaker") or default_speaker(list(self.speakers))
        return (job.window[1] - job.window[0], speaker, params["num_steps"],
                params["guidance_scale"], params["sway_coefficient"])

    def next_batch(self) -> list[Job]:
        """The oldest request's next job and the ready jobs it can share a DiT call with."""
        jobs = [job for r in self.requests.values() if (job := next_job(r, self.chunking))]
        if not jobs:
            return []
        key = self.batch_key(jobs[0])
        same = [job for job in jobs if self.batch_key(job) == key][: self.max_batch_size]
        return same[: self.fitting(key[0] * self.chunking.frames_per_code, len(same))]

    def fitting(self, frames: int, count: int) -> int:
        """How many of `count` inputs of `frames` frames each one batch takes."""
        return max(1, min(count, self.max_batch_frames // max(frames, 1)))

    def decode(self, batch: list[Job]) -> list[np.ndarray]:
        """Each job's new audio samples."""
        import torch

        from vllm_omni.engine.code2wav.sampler import sample_mels

        _, speaker_name, num_steps, guidance, sway = self.batch_key(batch[0])
        speaker = self.speakers[speaker_name]
        n = len(batch)
        noise = torch.stack([window_noise(job, self.chunking, self.dtype) for job in batch])
        mels = sample_mels(
            self.token2wav.code2wav_dit_model,
            torch.tensor([job.window_codes for job in batch], device=self.device),
            speaker["cond"].to(self.device, self.dtype)[None].expand(n, -1),
            speaker["ref_mel"].to(self.device, self.dtype).expand(n, -1, -1),
            noise.to(self.device), num_steps, guidance, sway,
        )
        # The vocoder voices equal-length inputs together (streamed chunks differ in their
        # context at a stream's start and end).
        voiced = [vocoder_input(job, mel, self.chunking) for job, mel in zip(batch, mels,
                                                                            strict=True)]
        waves: list[np.ndarray | None] = [None] * n
        for length in {v.shape[1] for v in voiced}:
            same = [i for i in range(n) if voiced[i].shape[1] == length]
            step = self.fitting(length, len(same))
            for group in (same[k:k + step] for k in range(0, len(same), step)):
                out = self.token2wav.code2wav_bigvgan_model(
                    torch.stack([voiced[i] for i in group]))
                out = out.reshape(len(group), -1).float().numpy()
                per_frame = out.shape[1] // length
                for row, i in enumerate(group):
                    first, last = batch[i].vocoder_cut
                    waves[i] = out[row, first * per_frame:last * per_frame]
        return waves

    @property
    def has_work(self) -> bool:
        return any(next_job(r, self.chunking) for r in self.requests.values())

    def step(self) -> None:
        batch = self.next_batch()
        if not batch:
            return
        try:
            waves = self.decode(batch)
        except Exception as e:
            ids = [job.request.request_id for job in batch]
            logger.error("code2wav requests %s failed:\n%s", ids, traceback.format_exc())
            self.fail(ids, repr(e), "internal")
            return
        for job, wave in zip(batch, waves, strict=True):
            request = job.request
            request.decoded = job.end
            if job.last:
                del self.requests[request.request_id]
            self.conn.send(Code2WavOutput(request.request_id, job.last, wave, self.sample_rate,
                                          int(request.params["seed"]), request.complete))


def run_code2wav_core(model: str, options: Code2WavOptions, conn: Connection) -> None:
    serve_core(lambda: Code2WavCore(model, options, conn), conn, "Code2WavCore")
