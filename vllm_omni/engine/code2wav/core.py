"""The code2wav engine core: turns codec tokens into audio in its own process (the loop and
the messages are the runtime's, engine/runtime/).

It runs Qwen2.5-Omni's token2wav (models/qwen2_5_omni/token2wav.py: flow-matching DiT, then
the BigVGAN vocoder) with our sampler (sampler.py). A request is decoded whole (HF's result)
or, streamed, chunk by chunk as its codes arrive (chunks.py). Ready work with the same DiT
window length, voice and solver settings is decoded as one batch (up to `max_batch_size` and
`max_batch_frames`), each from its own seed's noise, so a request's waveform does not depend
on what it is batched with: decoded whole it equals HF's for its seed. Oldest request first;
messages are read between batches, so an abort drops a request at once or right after its
batch.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
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
from vllm_omni.engine.runtime import AddRequest, CoreBase, CoreOutput, ExtendRequest
from vllm_omni.models.qwen2_5_omni.speakers import default_speaker, speakers
from vllm_omni.models.qwen2_5_omni.token2wav import compile_token2wav, load_token2wav

PARAMS = {"seed", "speaker", "num_steps", "guidance_scale", "sway_coefficient", "stream"}
HF_DEFAULTS = {"num_steps": 10, "guidance_scale": 0.5, "sway_coefficient": -1.0}


@dataclass
class Code2WavOptions:
    dtype: str = "float32"  # HF runs token2wav in float32 whatever the rest of the model
    device: str = "cpu"
    # None on CPU: half the cores. Code2wav runs beside the talker (streamed audio overlaps
    # them), whose vLLM worker binds its own cores; with all cores the two contend.
    num_threads: int | None = None
    max_batch_size: int = 8
    # torch.compile the DiT and the vocoder: equal to eager within float rounding and faster
    # (benchmarks/bench_code2wav_compile.py), but the first decode waits for the compiler.
    compile: bool = False
    # Mel frames per DiT batch and per vocoder batch (at least one request). Past about a
    # thousand frames the activations leave a CPU's caches and a batch costs more per request
    # than one by one; a GPU wants far more.
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
class Code2WavOutput(CoreOutput):
    """New audio of one request: the samples it adds to the request's waveform."""

    waveform: np.ndarray | None = None
    sample_rate: int = 0
    input_complete: bool = True  # whether all codes had arrived when this audio was made


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


class Code2WavCore(CoreBase):
    """Decodes requests whole or chunk by chunk, batching ready work of the same shape."""

    def __init__(self, model: str, options: Code2WavOptions, conn: Connection) -> None:
        import torch

        threads = options.num_threads
        if threads is None and options.device == "cpu":
            threads = max(1, (os.cpu_count() or 2) // 2)
        super().__init__(conn, threads)
        self.device = options.device
        self.defaults = {**HF_DEFAULTS, **options.defaults}
        self.token2wav, self.sample_rate = load_token2wav(model, options.dtype, options.device)
        if options.compile:
            compile_token2wav(self.token2wav)
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

    def info(self) -> dict[str, Any]:
        return {"sample_rate": self.sample_rate, "speakers": list(self.speakers),
                "defaults": self.defaults, "chunk_codes": self.chunking.chunk_codes,
                "first_chunk_codes": self.chunking.first_chunk}

    def add(self, msg: AddRequest) -> None:
        """`msg.prompt`: {"codes": [...], "complete": whether more codes follow}."""
        try:
            check_params(msg.params, list(self.speakers))
        except ValueError as e:
            self.fail([msg.request_id], e, "invalid")
            return
        params = {**self.defaults, **msg.params}
        if params.get("seed") is None:
            params["seed"] = self.new_seed()
        self.requests[msg.request_id] = Code2WavRequest(
            msg.request_id, list(msg.prompt["codes"]), params, msg.prompt.get("complete", True))
        self.check_not_empty(msg.request_id)

    def extend(self, msg: ExtendRequest) -> None:
        """`msg.payload`: {"codes": the new codes, "complete": whether more follow}."""
        request = self.requests.get(msg.request_id)
        if request is not None:  # else aborted or failed already
            request.codes += msg.payload["codes"]
            request.complete = msg.payload["complete"]
            self.check_not_empty(msg.request_id)

    def drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def check_not_empty(self, request_id: str) -> None:
        request = self.requests[request_id]
        if request.complete and not request.codes:
            self.fail([request_id], "no codec tokens to decode", "invalid")

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
            self.fail([job.request.request_id for job in batch], e, "internal")
            return
        for job, wave in zip(batch, waves, strict=True):
            request = job.request
            request.decoded = job.end
            if job.last:
                del self.requests[request.request_id]
            self.send(Code2WavOutput(request.request_id, job.last, int(request.params["seed"]),
                                     waveform=wave, sample_rate=self.sample_rate,
                                     input_complete=request.complete))
