"""One-stage vllm-omni against plain vLLM on the same model and requests, side by side.

    python benchmarks/bench_llm.py offline   # OmniLLM.generate vs vLLM LLM.generate
    python benchmarks/bench_llm.py online    # `vllm serve M --omni` vs `vllm serve M`

Both sides are started once and measured in alternating rounds, so background load hits
both alike; while one side is measured the other side's engine processes are frozen
(SIGSTOP), since an idle vLLM worker still polls and would take CPU from the measured side on
a 2-core machine. The summary reports medians over rounds and ours/vLLM ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORDS = "the cat sat on a mat and told the dog a long story about image audio video".split()


def prompts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=words)) for _ in range(n)]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


@contextlib.contextmanager
def frozen(pids: list[int]):
    """SIGSTOP these processes for the duration (the side not being measured)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def descendants(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


# -- offline ------------------------------------------------------------------------------


def run_offline(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_omni import OmniLLM

    texts = prompts(args.num_prompts, args.prompt_words)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(max_model_len=1024, dtype=args.dtype)
    before = set(descendants(os.getpid()))
    ours = OmniLLM(args.model, **common)
    ours_pids = sorted(set(descendants(os.getpid())) - before)
    theirs = LLM(args.model, disable_log_stats=True, **common)
    theirs_pids = sorted(set(descendants(os.getpid())) - before - set(ours_pids))
    sides = {
        "vllm-omni": lambda: ours.generate(texts, params, use_tqdm=False),
        "vllm": lambda: theirs.generate(texts, params, use_tqdm=False),
    }
    idle = {"vllm-omni": theirs_pids, "vllm": ours_pids}
    for run in sides.values():  # warm-up
        run()
    tps: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            with frozen(idle[name]):
                start = time.perf_counter()
                outs = sides[name]()
                elapsed = time.perf_counter() - start
            n_tokens = sum(
                len(o.token_ids) if hasattr(o, "stage") else len(o.outputs[0].token_ids)
                for o in outs
            )
            tps[name].append(n_tokens / elapsed)
    ours.shutdown()
    result = {name: {"output_tok_per_s": median(v), "rounds": v} for name, v in tps.items()}
    result["ratio_throughput"] = (
        result["vllm-omni"]["output_tok_per_s"] / result["vllm"]["output_tok_per_s"]
    )
    return result


# -- online -------------------------------------------------------------------------------


def start_server(
    model: str, port: int, omni: bool, log: Path, extra: list[str] | None = None
) -> subprocess.Popen:
    flags = [
        *(extra or []),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--max-model-len",
        "1024",
        "--served-model-name",
        "bench",
        "--disable-uvicorn-access-log",
    ]
    if omni:
        cmd = [str(Path(sys.executable).parent / "vllm"), "serve", model, "--omni", *flags]
    else:
        # vllm-cpu 0.32.0's `vllm serve` looks up the version of a package named "vllm" and
        # fails (the distribution is "vllm-cpu"); its API server module is the same server.
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.launchers.api_server.entry",
            "--model",
            model,
            *flags,
        ]
    return subprocess.Popen(
        cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {url} exited")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


async def one_request(client, url: str, text: str, max_tokens: int) -> tuple[float, float, int]:
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c["delta"].get("content") for c in chunk["choices"]):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft, time.perf_counter() - start, tokens


async def load(url: str, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def guarded(text: str):
            async with sem:
                return await one_request(client, url, text, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(t) for t in texts))
        wall = time.perf_counter() - start
    return {
        "ttft_ms": 1000 * median([r[0] for r in results]),
        "output_tok_per_s": sum(r[2] for r in results) / wall,
    }


def run_online(args: argparse.Namespace) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-llm-"))
    servers = {
        "vllm-omni": (args.port, True),
        "vllm": (args.port + 1, False),
    }
    procs = {}
    try:
        for name, (port, omni) in servers.items():
            procs[name] = start_server(args.model, port, omni, log_dir / f"{name}.log")
        for name, (port, _) in servers.items():
            wait_ready(f"http://127.0.0.1:{port}", procs[name])
        result = {}
        for conc in args.concurrency:
            n = max(conc * args.requests_per_user, 4)
            texts = prompts(n, args.prompt_words, seed=conc)
            per_side: dict[str, list[dict]] = {name: [] for name in servers}
            for port, _ in servers.values():  # warm-up
                asyncio.run(load(f"http://127.0.0.1:{port}", texts[:conc], conc, 8))
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for name in order:
                    url = f"http://127.0.0.1:{servers[name][0]}"
                    other = next(p for n, p in procs.items() if n != name)
                    with frozen([other.pid, *descendants(other.pid)]):
                        result_round = asyncio.run(load(url, texts, conc, args.max_tokens))
                    per_side[name].append(result_round)
            summary = {
                name: {
                    "ttft_ms": median([x["ttft_ms"] for x in runs]),
                    "output_tok_per_s": median([x["output_tok_per_s"] for x in runs]),
                    "rounds": runs,
                }
                for name, runs in per_side.items()
            }
            ours, theirs = summary["vllm-omni"], summary["vllm"]
            summary["ratio_throughput"] = ours["output_tok_per_s"] / theirs["output_tok_per_s"]
            summary["ratio_ttft"] = ours["ttft_ms"] / theirs["ttft_ms"]
            result[f"concurrency_{conc}"] = summary
            print(json.dumps({f"concurrency_{conc}": summary}, indent=1), flush=True)
        return result
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["offline", "online"])
    parser.add_argument("--model", default=None, help="model folder (default: qwen2-small)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests-per-user", type=int, default=4)
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args()
    if args.model is None:
        from vllm_omni.testing.tiny_models import get_or_make

        args.model = str(get_or_make("qwen2-small", dtype=args.dtype))
    result = run_offline(args) if args.mode == "offline" else run_online(args)
    result["args"] = vars(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
