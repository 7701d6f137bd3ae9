"""How long an AR stage takes to start: vllm-omni's default against vLLM's AOT compile.

    python benchmarks/bench_start.py                 # qwen2-tiny from the tiny factory
    python benchmarks/bench_start.py --model /path/to/model --rounds 3

On CPU, vllm-omni starts AR stages with VLLM_USE_AOT_COMPILE=0 unless the user set it (vLLM
0.32 cannot load its AOT artifacts back on CPU, so it compiles at every start). Each start
here is a fresh process that builds `OmniLLM(model)` and generates one token; "vllm-aot"
sets VLLM_USE_AOT_COMPILE=1 (vLLM's default with torch >= 2.10), "omni" leaves it to
vllm-omni. A cold start has an empty vLLM cache folder; a warm one reuses a folder a start
of the same side filled. The sides alternate within each round. Reported: medians of the
seconds to the first token (imports included) and of vLLM's own "init engine" figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, time
start = time.perf_counter()
from vllm import SamplingParams
from vllm_omni import OmniLLM

if __name__ == "__main__":
    llm = OmniLLM(sys.argv[1], max_model_len=256)
    ready = time.perf_counter() - start
    llm.generate(["hello"], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.shutdown()
    print("RESULT " + json.dumps({"ready": ready}), flush=True)
"""
INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")


def start_once(model: str, aot: bool, cache: Path, script: Path) -> dict[str, float]:
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache)}
    env.pop("VLLM_USE_AOT_COMPILE", None)
    if aot:
        env["VLLM_USE_AOT_COMPILE"] = "1"
    out = subprocess.run([sys.executable, str(script), model], env=env, capture_output=True,
                         text=True, timeout=600)
    text = out.stdout + out.stderr
    result = re.search(r"^RESULT (.*)$", text, re.M)
    init = INIT.search(text)
    if out.returncode or not result or not init:
        raise RuntimeError(f"start failed ({out.returncode}):\n{text[-3000:]}")
    return {**json.loads(result.group(1)), "init": float(init.group(1)),
            "recompiled": "load failure" in text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a folder (default: qwen2-tiny)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.model is None:
        from vllm_omni.testing.tiny_models import get_or_make

        args.model = str(get_or_make("qwen2-tiny"))
    sides = {"vllm-aot": True, "omni": False}
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "child.py"
        script.write_text(CHILD)
        warm = {side: Path(tmp) / f"warm-{side}" for side in sides}
        for side, aot in sides.items():  # fill each side's warm cache once
            start_once(args.model, aot, warm[side], script)
        for r in range(args.rounds):
            for side, aot in sides.items():
                cold = Path(tmp) / f"cold-{side}-{r}"
                runs.setdefault((side, "cold"), []).append(
                    start_once(args.model, aot, cold, script))
                runs.setdefault((side, "warm"), []).append(
                    start_once(args.model, aot, warm[side], script))
                print(side, r, {k: v[-1] for k, v in runs.items() if k[0] == side}, flush=True)
    print(f"\nmodel {args.model}, {args.rounds} rounds, {platform.processor() or 'cpu'}, "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    print("| cache | vllm-aot ready s | omni ready s | ratio | vllm-aot init s | omni init s |"
          " recompiled (aot / omni) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for cache in ("cold", "warm"):
        a, o = runs[("vllm-aot", cache)], runs[("omni", cache)]
        ready = [statistics.median(r["ready"] for r in x) for x in (a, o)]
        init = [statistics.median(r["init"] for r in x) for x in (a, o)]
        recompiled = [sum(r["recompiled"] for r in x) for x in (a, o)]
        print(f"| {cache} | {ready[0]:.1f} | {ready[1]:.1f} | {ready[0] / ready[1]:.2f} | "
              f"{init[0]:.1f} | {init[1]:.1f} | {recompiled[0]}/{len(a)} / "
              f"{recompiled[1]}/{len(o)} |")


if __name__ == "__main__":
    main()
