"""Stages on a Ray cluster: what distribution costs.

    python benchmarks/bench_ray.py hop         # one stage hop, 1 / 16 / 128 MiB
    python benchmarks/bench_ray.py pipeline    # LLM -> LLM -> DiT, one host vs three nodes

Both start a three-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, three
raylets with their own object stores, on loopback).

hop: a producer actor makes a payload and hands it on as a stage does; the consumer actor
has the tensors in hand. Timed from the driver, from the producer's call to the consumer's
answer (so both include two actor calls, whose cost alone is the `calls` column):
- object store: producer on one node, consumer on another (`ObjectStoreConnector`: ray.put
  there, the ObjectRef through the driver, ray.get here);
- shared memory: both on one node (`SharedMemoryConnector`, as on one host);
- copy: a plain in-process clone of the tensors (the floor).

pipeline: the LLM -> LLM -> DiT pipeline of tests/test_ray_cluster.py, N prompts at once,
through OmniLLM on one host, and with each stage pinned to its own node; engine start-up
is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

# One machine, loopback only: keep Ray from rewriting 127.0.0.1 to the interface address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

SIZES_MB = [1, 16, 128]
RESOURCES = ["node_a", "node_b", "node_c"]


def start_cluster(object_store_mb: int = 1024):
    from ray.cluster_utils import Cluster

    store = object_store_mb << 20
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False,
        "object_store_memory": store})
    for name in RESOURCES[1:]:
        cluster.add_node(num_cpus=2, resources={name: 1}, object_store_memory=store)
    return cluster


def make(size_mb: int) -> dict[str, torch.Tensor]:
    n = size_mb * 1024 * 1024 // 2
    return {"hidden_states": torch.ones(n // 1024, 1024, dtype=torch.bfloat16)}


def hop(rounds: int) -> list[dict]:
    import ray

    from vllm_omni.transfer.connectors import SharedMemoryConnector
    from vllm_omni.transfer.object_store import ObjectStoreConnector

    @ray.remote(num_cpus=0)
    class End:
        def __init__(self) -> None:
            torch.set_num_threads(1)
            self.data = {}

        def make(self, size_mb: int) -> None:
            self.data = make(size_mb)

        def put(self, via: str):
            connector = ObjectStoreConnector() if via == "store" else SharedMemoryConnector()
            return connector.put(self.data)

        def take(self, handle) -> int:
            connector = (SharedMemoryConnector() if hasattr(handle, "segment")
                         else ObjectStoreConnector())
            tensors = connector.get(handle)
            return sum(t.numel() * t.element_size() for t in tensors.values())

        def nothing(self, x=None) -> None:
            return None

    def on(resource: str) -> End:
        return End.options(resources={resource: 0.01}).remote()

    producer, remote, local = on("node_b"), on("node_c"), on("node_b")
    rows = []
    for size in SIZES_MB:
        ray.get(producer.make.remote(size))
        row = {"size_mb": size}
        for name, consumer, via in (("object_store", remote, "store"),
                                    ("shared_memory", local, "shm")):
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                handle = ray.get(producer.put.remote(via))
                assert ray.get(consumer.take.remote(handle)) == size << 20
                times.append(time.perf_counter() - start)
            row[f"{name}_ms"] = round(statistics.median(times) * 1e3, 2)
        calls = []
        for _ in range(rounds):
            start = time.perf_counter()
            ray.get(remote.nothing.remote(ray.get(producer.nothing.remote())))
            calls.append(time.perf_counter() - start)
        row["calls_ms"] = round(statistics.median(calls) * 1e3, 2)
        data, copies = make(size), []
        for _ in range(rounds):
            start = time.perf_counter()
            {k: v.clone() for k, v in data.items()}
            copies.append(time.perf_counter() - start)
        row["copy_ms"] = round(statistics.median(copies) * 1e3, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def pipeline(prompts: int, rounds: int, ray_address: str) -> dict:
    from vllm_omni import OmniLLM
    from vllm_omni.testing.tiny_models import get_or_make, make_tiny

    folder = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    llm_folder = str(get_or_make("qwen2-tiny"))
    dit = make_tiny("flux-tiny", folder / "flux-tiny")
    text = (Path(__file__).parents[1] / "tests" / "test_ray_cluster.py").read_text()
    yaml = text.split('PIPELINE = """', 1)[1].split('"""', 1)[0].format(dit=dit)
    # The benchmark's DiT reads only text (no test module on the path here).
    yaml = yaml.replace("test_ray_cluster:text_and_states", "vllm_omni.processors:joined_text")
    (folder / "one-host.yaml").write_text(yaml)
    batch = [f"prompt number {i} about a red fox" for i in range(prompts)]
    result = {"prompts": prompts}
    for name, kwargs in (("one_host", {}), ("three_nodes", {"ray_address": ray_address})):
        llm = OmniLLM(llm_folder, stage_configs_path=str(folder / "one-host.yaml"),
                      max_model_len=512, **kwargs)
        try:
            llm.generate(batch[:2], use_tqdm=False)  # warm
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                llm.generate(batch, use_tqdm=False)
                times.append(time.perf_counter() - start)
        finally:
            llm.shutdown()
        result[f"{name}_s"] = round(statistics.median(times), 3)
        result[f"{name}_requests_per_s"] = round(prompts / statistics.median(times), 2)
        print(json.dumps(result), flush=True)
    result["ratio"] = round(result["three_nodes_s"] / result["one_host_s"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["hop", "pipeline"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    import ray

    torch.set_num_threads(1)
    cluster = start_cluster()
    try:
        if args.what == "hop":
            ray.init(address=cluster.address)
            out = hop(args.rounds)
            ray.shutdown()
        else:
            out = pipeline(args.prompts, args.rounds, cluster.address)
        print(json.dumps(out, indent=1))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
