"""The thinker inside the omni pipeline (hidden states kept) against vLLM serving it alone.

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bench_thinker.py
    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bench_thinker.py --model qwen2_5-omni-scaled

Three engines over the same Qwen2.5-Omni checkpoint, all started first and then run in turn:
`vllm` = vLLM's `LLM` (the thinker alone, its defaults: compiled, prefix caching on),
`omni compiled` = vllm-omni's thinker stage keeping every request's hidden states and
embeddings (the defaults: compiled, prefix caching on), `omni eager` = the same stage as it
ran before (enforce_eager, no prefix caching). Each round sends `--prompts` prompts of
`--prompt-len` random token ids at once (new ids every round and side, so no prefix is
cached) and `--tokens` greedy tokens each (eos ignored). Reports generated tokens/s,
medians over rounds (the side order alternates) and the ratio to vLLM.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from vllm import LLM, SamplingParams

from vllm_omni.testing.tiny_models import get_or_make

THINKER = """
name: thinker-only
stages:
  - name: thinker
    engine: ar
    engine_args: {engine_args}
    output: hidden_states
    final_output: true
    weights_prefix: thinker.
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5-omni-tiny")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from vllm_omni import OmniLLM

    folder = str(get_or_make(args.model))
    common = {"dtype": args.dtype, "max_model_len": 2048}
    configs = Path(tempfile.mkdtemp(prefix="bench-thinker-"))
    engines = {"vllm": LLM(folder, **common)}
    for name, engine_args in (("omni compiled", "{}"),
                              ("omni eager", "{enforce_eager: true, "
                                             "enable_prefix_caching: false}")):
        path = configs / f"{name.replace(' ', '_')}.yaml"
        path.write_text(THINKER.format(engine_args=engine_args))
        engines[name] = OmniLLM(folder, stage_configs_path=str(path), **common)
    vocab = engines["vllm"].get_tokenizer().vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)

    def run(name: str) -> float:
        ids = torch.randint(16, vocab - 16, (args.prompts, args.prompt_len), generator=generator)
        prompts = [{"prompt_token_ids": row.tolist()} for row in ids]
        start = time.perf_counter()
        outs = engines[name].generate(prompts, params, use_tqdm=False)
        if name != "vllm":
            assert all(o.tensors["hidden_states"].shape[0] == args.prompt_len + args.tokens - 1
                       for o in outs)
        wall = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == args.tokens for o in outs)
        return args.prompts * args.tokens / wall

    rates: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for name in engines:  # warm-up
            run(name)
        for r in range(args.rounds):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                rates[name].append(run(name))
                print(f"round {r} {name}: {rates[name][-1]:.0f} tok/s", flush=True)
    finally:
        for name, engine in engines.items():
            if name != "vllm":
                engine.shutdown()
    base = statistics.median(rates["vllm"])
    print(f"\n{args.model}, {args.dtype}: {args.prompts} prompts x {args.prompt_len} tokens, "
          f"{args.tokens} generated each, {torch.get_num_threads()} threads, "
          f"medians of {args.rounds} rounds")
    print("| side | generated tok/s | vs vLLM |")
    print("| --- | --- | --- |")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"| {name} | {rate:.0f} | **{rate / base:.3f}** |")


if __name__ == "__main__":
    main()
