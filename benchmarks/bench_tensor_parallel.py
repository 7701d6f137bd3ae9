"""One AR stage with tensor_parallel_size 1 against 2, same model and requests, side by side.

    python benchmarks/bench_tensor_parallel.py            # qwen2-small from the tiny factory
    python benchmarks/bench_tensor_parallel.py --model /path/to/model --tp 1 4

Both pipelines (OmniLLM, one AR stage each) are started once in this process and measured in
alternating rounds; while one is measured the other's engine processes are frozen (SIGSTOP:
idle vLLM workers still poll). Two workloads: a batch of prompts (throughput) and a single
prompt (per-token latency). The summary gives medians and the ratio of each TP to the first.
On CPU the ranks are bound to cores by vllm-omni (one core set per rank); on GPUs the same
command runs each side on the first `tp` visible GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORDS = "the cat sat on a mat and told the dog a long story about image audio video".split()


def prompts(n: int, words: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)) for i in range(n)]


@contextlib.contextmanager
def frozen(pids: list[int]):
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def descendants() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    name = platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


def run(args: argparse.Namespace) -> dict:
    from vllm import SamplingParams

    from vllm_omni import OmniLLM

    batch = prompts(args.num_prompts, args.prompt_words)
    single = prompts(1, args.prompt_words)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    sides, pids = {}, {}
    for tp in args.tp:
        before = descendants()
        sides[tp] = OmniLLM(args.model, dtype=args.dtype, max_model_len=1024,
                            tensor_parallel_size=tp)
        pids[tp] = sorted(descendants() - before)
    workloads = {"batch": batch, "single": single}
    results: dict[str, dict[int, list[float]]] = {w: {tp: [] for tp in sides} for w in workloads}
    tokens_equal = True
    try:
        for llm in sides.values():  # warm-up
            llm.generate(batch[:4], params, use_tqdm=False)
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for workload, texts in workloads.items():
                outputs = {}
                for tp in order:
                    others = [p for t, ps in pids.items() if t != tp for p in ps]
                    with frozen(others):
                        start = time.perf_counter()
                        outs = sides[tp].generate(texts, params, use_tqdm=False)
                        elapsed = time.perf_counter() - start
                    outputs[tp] = [o.token_ids for o in outs]
                    results[workload][tp].append(sum(map(len, outputs[tp])) / elapsed)
                first = outputs[args.tp[0]]
                tokens_equal &= all(o == first for o in outputs.values())
    finally:
        for llm in sides.values():
            llm.shutdown()
    base = args.tp[0]
    summary: dict = {"model": args.model, "dtype": args.dtype, "machine": machine(),
                     "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                     "rounds": args.rounds, "greedy_tokens_equal": tokens_equal}
    for workload, by_tp in results.items():
        medians = {tp: statistics.median(v) for tp, v in by_tp.items()}
        summary[workload] = {
            f"tp{tp}": {"output_tok_per_s": medians[tp], "rounds": by_tp[tp],
                        f"ratio_to_tp{base}": medians[tp] / medians[base]}
            for tp in by_tp
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: qwen2-small)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args()
    if args.model is None:
        from vllm_omni.testing.tiny_models import get_or_make

        args.model = str(get_or_make("qwen2-small", dtype=args.dtype))
    text = json.dumps(run(args), indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
