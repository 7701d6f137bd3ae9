"""What code2wav decodes next for a request: all of it at once, or the next chunk of a stream.

A request decoded whole (the default) is HF's token2wav: the DiT denoises every code's frames
from the noise HF draws for the seed, and the vocoder voices the whole mel spectrogram.

A streamed request (`stream: true`) is decoded in chunks of `chunk_codes` as its codes
arrive (the first chunk can be shorter, `first_chunk_codes`, for earlier audio), so audio
starts before the talker has finished. The DiT's attention reaches
neighbouring blocks, so it denoises each chunk inside a window with up to `context_codes`
before it and `lookahead_codes` after it, and the chunk's frames are kept. The vocoder voices
the chunk's mel between the last frames already voiced and the window's frames after it, and
the chunk's samples are cut from its output. A chunk waits for its lookahead codes (or for the
last code), and the noise is drawn from the request's seed in chunk-sized pieces in order, so
the audio depends on the codes and the seed only, never on when the codes arrived; frames that
two windows share start from the same noise. The result approximates the whole decode; it is
not equal to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni.engine.code2wav.sampler import request_noise


@dataclass(frozen=True)
class ChunkSettings:
    chunk_codes: int
    context_codes: int
    lookahead_codes: int
    vocoder_context_frames: int
    frames_per_code: int  # the DiT's repeats
    mel_dim: int
    first_chunk_codes: int | None = None  # default: chunk_codes

    @property
    def first_chunk(self) -> int:
        return self.first_chunk_codes or self.chunk_codes

    def check(self, block_codes: int) -> None:
        """Windows must start on the DiT's attention block boundaries, as in the whole decode."""
        for name, value, least in (("chunk_codes", self.chunk_codes, 1),
                                   ("first_chunk_codes", self.first_chunk, 1),
                                   ("context_codes", self.context_codes, 0)):
            if value < least or value % block_codes:
                raise ValueError(f"{name} must be a positive multiple of the DiT's block "
                                 f"({block_codes} codes), got {value}")
        if self.lookahead_codes < 0 or self.vocoder_context_frames < 0:
            raise ValueError("lookahead_codes and vocoder_context_frames must be >= 0")


@dataclass
class Code2WavRequest:
    request_id: str
    codes: list[int]
    params: dict[str, Any]
    complete: bool  # all codes have arrived
    decoded: int = 0  # codes already turned into audio
    noise: torch.Tensor | None = None  # streamed: the noise drawn so far, (frames, mel_dim)
    generator: torch.Generator | None = None
    mel_tail: torch.Tensor | None = None  # streamed: the last mel frames voiced, (mel_dim, n)

    @property
    def streamed(self) -> bool:
        return bool(self.params.get("stream"))


@dataclass
class Job:
    """Turn codes [start, end) of a request into audio; the DiT sees codes [window)."""

    request: Code2WavRequest
    start: int
    end: int
    window: tuple[int, int]
    vocoder_cut: tuple[int, int] = field(default=(0, 0))  # set by vocoder_input

    @property
    def last(self) -> bool:
        return self.request.complete and self.end == len(self.request.codes)

    @property
    def window_codes(self) -> list[int]:
        return self.request.codes[self.window[0]:self.window[1]]


def next_job(request: Code2WavRequest, settings: ChunkSettings) -> Job | None:
    """The request's next piece of work, or None while it waits for codes."""
    n = len(request.codes)
    if not request.streamed:
        return Job(request, 0, n, (0, n)) if request.complete else None
    start = request.decoded
    size = settings.first_chunk if start == 0 else settings.chunk_codes
    if not request.complete and n < start + size + settings.lookahead_codes:
        return None
    end = min(start + size, n)
    window = (max(0, start - settings.context_codes), min(end + settings.lookahead_codes, n))
    return Job(request, start, end, window)


def window_noise(job: Job, settings: ChunkSettings, dtype: torch.dtype) -> torch.Tensor:
    """The starting noise (frames, mel_dim) of the job's window."""
    request, per_code = job.request, settings.frames_per_code
    seed = request.params["seed"]
    if not request.streamed:
        return request_noise(seed, len(request.codes) * per_code, settings.mel_dim, dtype)
    if request.generator is None:
        request.generator = torch.Generator().manual_seed(seed)
        request.noise = torch.empty(0, settings.mel_dim, dtype=dtype)
    start, end = job.window[0] * per_code, job.window[1] * per_code
    while request.noise.shape[0] < end:
        piece = torch.randn([settings.chunk_codes * per_code, settings.mel_dim], dtype=dtype,
                            generator=request.generator)
        request.noise = torch.cat([request.noise, piece])
    return request.noise[start:end]


def vocoder_input(job: Job, mel: torch.Tensor, settings: ChunkSettings) -> torch.Tensor:
    """The mel (mel_dim, frames) the vocoder voices for the job, given the window's mel; sets
    `job.vocoder_cut`, the frames of it that are the job's audio, and keeps the request's tail."""
    request, per_code = job.request, settings.frames_per_code
    first = (job.start - job.window[0]) * per_code
    last = (job.end - job.window[0]) * per_code
    chunk = mel[:, first:last]
    after = mel[:, last:last + settings.vocoder_context_frames]
    before = request.mel_tail if request.mel_tail is not None else mel[:, :0]
    job.vocoder_cut = (before.shape[1], before.shape[1] + chunk.shape[1])
    if request.streamed and settings.vocoder_context_frames:
        request.mel_tail = torch.cat([before, chunk], 1)[:, -settings.vocoder_context_frames:]
    return torch.cat([before, chunk, after], 1)
