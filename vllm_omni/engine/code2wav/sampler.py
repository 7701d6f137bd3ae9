"""Token2wav's flow-matching sampler, for a batch of requests with per-request noise.

HF's `sample` draws one noise tensor for its whole batch from the global generator, so a
request's waveform would depend on what it was batched with. Here each request brings its own
noise (`request_noise`: what HF draws for it alone after `torch.manual_seed(seed)`), and the
DiT runs once per solver evaluation for the whole batch. The schedule and the solver are HF's:
times on [0, 1] bent by the sway coefficient, and the 3/8-rule Runge-Kutta step, computed in
the same order so results match HF's to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

ONE_THIRD, TWO_THIRDS = 1 / 3, 2 / 3


def flow_times(num_steps: int, sway: float | None, dtype: torch.dtype) -> torch.Tensor:
    t = torch.linspace(0, 1, num_steps, dtype=dtype)
    if sway is not None:
        t += sway * (torch.cos(math.pi / 2 * t) - 1 + t)
    return t


def integrate(velocity: Callable, x: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """x at the last time, from x at the first, by the 3/8-rule RK4 over `times`."""
    for t0, t1 in zip(times[:-1], times[1:], strict=True):
        h = t1 - t0
        k1 = velocity(t0, x)
        k2 = velocity(t0 + h * ONE_THIRD, x + h * k1 * ONE_THIRD)
        k3 = velocity(t0 + h * TWO_THIRDS, x + h * (k2 - k1 * ONE_THIRD))
        k4 = velocity(t1, x + h * (k1 - k2 + k3))
        x = x + (k1 + 3 * (k2 + k3) + k4) * h / 8
    return x


def request_noise(seed: int, frames: int, mel_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The starting noise (frames, mel_dim) HF's `sample` draws for one request."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn([1, frames, mel_dim], dtype=dtype, generator=generator)[0]


def sample_mels(
    dit,
    codes: torch.Tensor,
    speaker_cond: torch.Tensor,
    reference_mel: torch.Tensor,
    noise: torch.Tensor,
    num_steps: int,
    guidance_scale: float,
    sway: float | None,
) -> torch.Tensor:
    """Mel spectrograms (B, mel_dim, frames) for B requests of equal code length, each from
    its starting noise (B, frames, mel_dim)."""
    frames = codes.shape[1] * dit.repeats
    if frames > dit.config.max_position_embeddings:
        raise ValueError(f"{codes.shape[1]} codes make {frames} mel frames, more than the "
                         f"model's {dit.config.max_position_embeddings}")
    cond = speaker_cond.unsqueeze(1).repeat(1, frames, 1)

    def velocity(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        kwargs = dict(hidden_states=x, speaker_embedding=cond, condition_vector=reference_mel,
                      quantized_code=codes, time_step=t)
        if guidance_scale < 1e-5:
            return dit(**kwargs, drop_audio_conditioning=False, drop_code=False, apply_cfg=False)
        guided, unguided = torch.chunk(dit(**kwargs, apply_cfg=True), 2, dim=0)
        return guided + (guided - unguided) * guidance_scale

    mel = integrate(velocity, noise, flow_times(num_steps, sway, cond.dtype).to(codes.device))
    return mel.permute(0, 2, 1)
