"""Load against a real server: a mix of every request kind it offers, many clients at once,
a share of them hanging up halfway.

    python benchmarks/load.py --clients 200 --requests 1000            # the demo server
    python benchmarks/load.py --model qwen2_5-omni-tiny --clients 200   # spoken chat, speech

It starts `vllm-omni serve` (a tiny factory model, a folder, or the demo when --model is
omitted) with the server flags given after `--`, records its processes, RSS and our
shared-memory segments, runs the mix, and checks the server afterwards: /health, the same
processes, no segment left, RSS. Results: per request kind, how requests ended and latency
percentiles; written to --out as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from vllm_omni.testing.load import failures, run_mix, server_state, summary


def start(model: str | None, flags: list[str], port: int, log: Path) -> subprocess.Popen:
    cmd = [str(Path(sys.executable).parent / "vllm-omni"), "serve", *([model] if model else []),
           "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log", *flags]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server not ready; see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="tiny factory name or folder (default: demo)")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--hangup-share", type=float, default=0.2)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a request may take")
    parser.add_argument("--port", type=int, default=8420)
    parser.add_argument("--out", default="benchmarks/out/load.json")
    parser.add_argument("server_flags", nargs="*", help="after --: flags for vllm-omni serve")
    args = parser.parse_args()

    model = args.model
    if model is not None and not Path(model).exists():
        from vllm_omni.testing.tiny_models import get_or_make

        model = str(get_or_make(model))
    log = Path(tempfile.mkdtemp(prefix="bench-load-")) / "server.log"
    proc = start(model, args.server_flags, args.port, log)
    url = f"http://127.0.0.1:{args.port}"
    try:
        before = server_state(proc.pid)
        start_time = time.perf_counter()
        outcomes = asyncio.run(run_mix(url, clients=args.clients, requests=args.requests,
                                       hangup_share=args.hangup_share, timeout=args.timeout))
        wall = time.perf_counter() - start_time
        time.sleep(2)  # let aborted requests drain
        after = server_state(proc.pid)
        health = httpx.get(url + "/health", timeout=10).status_code
    finally:
        proc.terminate()
        proc.wait(120)
    report = {
        "clients": args.clients, "requests": args.requests, "wall_s": round(wall, 1),
        "kinds": summary(outcomes), "failures": [o.result for o in failures(outcomes)][:20],
        "health_after": health, "processes_same": before["processes"] == after["processes"],
        "segments_before": before["segments"], "segments_after": after["segments"],
        "rss_before_gib": round(before["rss"] / 2**30, 3),
        "rss_after_gib": round(after["rss"] / 2**30, 3), "server_log": str(log),
    }
    print(json.dumps(report, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
