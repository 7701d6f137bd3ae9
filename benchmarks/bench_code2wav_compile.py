"""Code2wav eager against torch.compile (inductor) for the DiT and the vocoder.

    python benchmarks/bench_code2wav_compile.py --model qwen2_5-omni-scaled
    python benchmarks/bench_code2wav_compile.py --device cuda --model qwen2_5-omni-scaled

Decodes windows of `--codes` codes (HF's defaults: 10 solver steps, CFG), batch sizes
`--batch`, eager and compiled with dynamic shapes, and reports per-window seconds (median of
`--repeats`), the speed-up, the largest difference between the two waveforms, the compile
time of the first call, and how many graphs Dynamo compiled over all the shapes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_omni.engine.code2wav.sampler import request_noise, sample_mels
from vllm_omni.models.qwen2_5_omni.speakers import speakers
from vllm_omni.models.qwen2_5_omni.token2wav import load_token2wav
from vllm_omni.testing.tiny_models import get_or_make


def decode(token2wav, dit, vocoder, codes: torch.Tensor, speaker: dict, device: str):
    n, frames = codes.shape[0], codes.shape[1] * token2wav.code2wav_dit_model.repeats
    mel_dim = token2wav.code2wav_dit_model.mel_dim
    noise = torch.stack([request_noise(i, frames, mel_dim, torch.float32) for i in range(n)])
    with torch.no_grad():
        mels = sample_mels(dit, codes.to(device), speaker["cond"].to(device)[None].expand(n, -1),
                           speaker["ref_mel"].to(device).expand(n, -1, -1), noise.to(device),
                           10, 0.5, -1.0)
        return vocoder(mels).reshape(n, -1).float().cpu()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5-omni-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--codes", type=int, nargs="+", default=[60, 100])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    folder = str(get_or_make(args.model))
    token2wav, _ = load_token2wav(folder, "float32", args.device)
    speaker = next(iter(speakers(folder).values()))
    eager = (token2wav.code2wav_dit_model, token2wav.code2wav_bigvgan_model)
    torch._dynamo.utils.counters.clear()
    start = time.perf_counter()
    compiled = tuple(torch.compile(m, dynamic=True) for m in eager)
    vocab = token2wav.code2wav_dit_model.config.num_embeds
    generator = torch.Generator().manual_seed(0)
    first = None
    print(f"{args.model} on {args.device}, {torch.get_num_threads()} threads")
    print("| codes | batch | eager s | compiled s | speed-up | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for length in args.codes:
        for n in args.batch:
            codes = torch.randint(0, vocab - 1, (n, length), generator=generator)
            reference = decode(token2wav, *eager, codes, speaker, args.device)
            out = decode(token2wav, *compiled, codes, speaker, args.device)  # compiles
            first = first or time.perf_counter() - start
            times = {"eager": [], "compiled": []}
            for _ in range(args.repeats):
                for name, models in (("eager", eager), ("compiled", compiled)):
                    t = time.perf_counter()
                    decode(token2wav, *models, codes, speaker, args.device)
                    times[name].append(time.perf_counter() - t)
            e, c = (statistics.median(times[k]) for k in ("eager", "compiled"))
            diff = (out - reference).abs().max().item()
            print(f"| {length} | {n} | {e:.3f} | {c:.3f} | **{e / c:.2f}** | {diff:.1e} |",
                  flush=True)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"\nfirst compiled call (compile included): {first:.1f} s; Dynamo graphs: {frames}")


if __name__ == "__main__":
    main()
