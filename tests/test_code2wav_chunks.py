"""Code2wav's decoding plan (engine/code2wav/chunks.py): which codes each piece of work turns
into audio, what the DiT sees around them, and the noise they start from."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_omni.engine.code2wav.chunks import (
    ChunkSettings,
    Code2WavRequest,
    next_job,
    vocoder_input,
    window_noise,
)
from vllm_omni.engine.code2wav.sampler import request_noise

SETTINGS = ChunkSettings(chunk_codes=24, context_codes=24, lookahead_codes=12,
                         vocoder_context_frames=8, frames_per_code=2, mel_dim=16)


def request(codes: list[int], complete: bool, stream: bool = True) -> Code2WavRequest:
    return Code2WavRequest("r", list(codes), {"seed": 5, "stream": stream}, complete)


def run_jobs(req: Code2WavRequest, arrivals: list[list[int]]) -> list[tuple]:
    """Feed codes in pieces (the last piece completes the request), doing every ready job;
    returns (start, end, window, last, noise of the window) per job."""
    done = []
    for i, piece in enumerate(arrivals):
        req.codes += piece
        req.complete = i == len(arrivals) - 1
        while (job := next_job(req, SETTINGS)) is not None:
            noise = window_noise(job, SETTINGS, torch.float32)
            done.append((job.start, job.end, job.window, job.last, noise))
            req.decoded = job.end
            if job.last:
                return done
    return done


def test_whole_requests_wait_for_their_last_code():
    req = request(list(range(50)), complete=False, stream=False)
    assert next_job(req, SETTINGS) is None
    req.complete = True
    job = next_job(req, SETTINGS)
    assert (job.start, job.end, job.window, job.last) == (0, 50, (0, 50), True)
    # HF's noise for the seed: what `sample` draws after torch.manual_seed(seed)
    torch.manual_seed(5)
    hf = torch.randn([1, 100, 16])[0]
    assert torch.equal(window_noise(job, SETTINGS, torch.float32), hf)
    assert torch.equal(request_noise(5, 100, 16, torch.float32), hf)


def test_streamed_chunks_and_their_windows():
    jobs = run_jobs(request([], False), [list(range(100))])
    assert [(s, e, w, last) for s, e, w, last, _ in jobs] == [
        (0, 24, (0, 36), False),
        (24, 48, (0, 60), False),
        (48, 72, (24, 84), False),
        (72, 96, (48, 100), False),
        (96, 100, (72, 100), True),
    ]


def test_a_shorter_first_chunk():
    settings = ChunkSettings(24, 24, 12, 8, 2, 16, first_chunk_codes=12)
    req = request(list(range(60)), complete=True)
    jobs = []
    while (job := next_job(req, settings)) is not None:
        jobs.append((job.start, job.end, job.window))
        req.decoded = job.end
        if job.last:
            break
    assert jobs == [(0, 12, (0, 24)), (12, 36, (0, 48)), (36, 60, (12, 60))]
    req = request(list(range(23)), complete=False)
    assert next_job(req, settings) is None  # 12 codes + 12 of lookahead
    req.codes.append(23)
    assert next_job(req, settings).window == (0, 24)


def test_a_chunk_waits_for_its_lookahead():
    req = request(list(range(35)), complete=False)
    assert next_job(req, SETTINGS) is None  # 24 codes + 12 of lookahead needed
    req.codes.append(35)
    assert next_job(req, SETTINGS).window == (0, 36)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_plan_does_not_depend_on_when_codes_arrive(seed):
    codes = list(range(137))
    whole = run_jobs(request([], False), [codes])
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(codes)), 9))
    pieces = [codes[a:b] for a, b in zip([0, *cuts], [*cuts, len(codes)], strict=True)]
    trickled = run_jobs(request([], False), pieces)
    assert len(trickled) == len(whole)
    for a, b in zip(whole, trickled, strict=True):
        assert a[:4] == b[:4]
        assert torch.equal(a[4], b[4])


def test_frames_seen_by_two_windows_start_from_the_same_noise():
    jobs = run_jobs(request([], False), [list(range(100))])
    (_, _, (a0, _), _, first), (_, _, (b0, _), _, second) = jobs[1], jobs[2]
    # window 2 starts at code 24: its first 36 codes' frames are frames 48.. of window 1
    overlap = (jobs[1][2][1] - b0) * 2
    assert torch.equal(first[(b0 - a0) * 2:], second[:overlap])


def test_vocoder_sees_the_voiced_tail_and_the_frames_after():
    req = request([], False)
    jobs = []
    req.codes, req.complete = list(range(60)), True
    while (job := next_job(req, SETTINGS)) is not None:
        frames = (job.window[1] - job.window[0]) * 2
        mel = torch.arange(frames, dtype=torch.float32)[None] + 2 * job.window[0]
        jobs.append((job, vocoder_input(job, mel, SETTINGS)))
        req.decoded = job.end
        if job.last:
            break
    # Each input is absolute frame numbers: the chunk's frames between 8 before and 8 after.
    (j1, v1), (j2, v2), (j3, v3) = jobs
    assert v1[0].tolist() == list(range(0, 56)) and j1.vocoder_cut == (0, 48)
    assert v2[0].tolist() == list(range(40, 104)) and j2.vocoder_cut == (8, 56)
    assert v3[0].tolist() == list(range(88, 120)) and j3.vocoder_cut == (8, 32)


def test_settings_must_keep_windows_on_block_boundaries():
    SETTINGS.check(12)
    with pytest.raises(ValueError, match="chunk_codes"):
        ChunkSettings(20, 24, 12, 8, 2, 16).check(12)
    with pytest.raises(ValueError, match="context_codes"):
        ChunkSettings(24, 6, 12, 8, 2, 16).check(12)
    with pytest.raises(ValueError, match="first_chunk_codes"):
        ChunkSettings(24, 24, 12, 8, 2, 16, first_chunk_codes=8).check(12)
