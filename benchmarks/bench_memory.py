"""Memory of `vllm serve M --omni` against vLLM's own server on the same model and budget.

    python benchmarks/bench_memory.py [--model qwen2-small] [--kv-gib 2] [--rounds 3]

Both servers get the same KV cache budget (VLLM_CPU_KVCACHE_SPACE on CPU; on a GPU pass
`--gpu` and the same `--kv-cache-memory-bytes` reaches both). Each round starts one side,
samples the summed RSS and PSS of every process of the server (API process, engine core,
workers) every 0.1 s while it serves a burst of streamed chat requests, and stops it; the
sides alternate, and the summary gives the median peaks and the ours/vLLM ratios (goal for
peak memory: <= 1.05). GPU memory is read from nvidia-smi when `--gpu` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

GIB = 1 << 30


def tree_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) summed over a process and its descendants; gone processes count 0."""
    import psutil

    rss = pss = 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    for p in procs:
        try:
            info = p.memory_full_info()
            rss, pss = rss + info.rss, pss + info.pss
        except psutil.Error:
            pass
    return rss, pss


def gpu_used() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                          "nounits"], capture_output=True, text=True, check=True).stdout
    return sum(int(x) for x in out.split()) << 20


def measure(side: str, args: argparse.Namespace, model: str, port: int, log: Path) -> dict:
    from bench_llm import load, start_server, wait_ready

    proc = start_server(model, port, side == "vllm-omni", log, args.extra)
    peak = {"rss": 0, "pss": 0, "gpu": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss, pss = tree_memory(proc.pid)
            peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)
            if args.gpu:
                peak["gpu"] = max(peak["gpu"], gpu_used())
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        texts = [f"tell me story number {i} about a cat" for i in range(args.requests)]
        stats = asyncio.run(load(url, texts, args.concurrency, args.max_tokens))
    finally:
        stop.set()
        sampler.join()
        proc.terminate()
        proc.wait(60)
    return {**peak, "tok_s": stats["output_tok_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2-small", help="a tiny factory name or a folder")
    parser.add_argument("--kv-gib", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--out", default="benchmarks/out/memory.json")
    args = parser.parse_args()
    args.extra = ["--kv-cache-memory-bytes", str(args.kv_gib * GIB)] if args.gpu else []
    if not args.gpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)

    from vllm_omni.testing.tiny_models import BUILDERS, get_or_make

    model = str(get_or_make(args.model)) if args.model in BUILDERS else args.model
    results: dict[str, list[dict]] = {"vllm-omni": [], "vllm": []}
    logs = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    for r in range(args.rounds):
        order = list(results) if r % 2 == 0 else list(reversed(results))
        for side in order:
            got = measure(side, args, model, 8300 + r, logs / f"{side}-{r}.log")
            print(side, {k: (round(v / GIB, 3) if k != "tok_s" else v) for k, v in got.items()})
            results[side].append(got)
    summary = {}
    for key in ("rss", "pss", "gpu"):
        ours = statistics.median(x[key] for x in results["vllm-omni"])
        theirs = statistics.median(x[key] for x in results["vllm"])
        if theirs:
            summary[key] = {"vllm-omni_gib": ours / GIB, "vllm_gib": theirs / GIB,
                            "ratio": ours / theirs}
    print(json.dumps(summary, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rounds": results, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
