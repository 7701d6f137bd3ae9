"""A worker rank of a parallel diffusion stage (started by the engine core, rank 0).

It loads the stage's transformer only (rank 0 holds the text encoders and the VAE), joins
the group, and runs its share of each call rank 0 sends, until rank 0 says stop or is gone.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Client
from pathlib import Path

PARENT_POLL = 0.5  # seconds between checks that the engine core still lives


def _exit_with_parent(parent: int) -> None:
    """Rank 0 may die while this rank waits in a collective: exit then, leaving nothing."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL)
    os._exit(0)


def main(spec: dict) -> None:
    import setproctitle

    rank = spec["rank"]
    setproctitle.setproctitle(f"vllm-omni::DiffusionRank{rank}")
    logging.basicConfig(level=logging.INFO,
                        format=f"(DiffusionRank{rank} pid={os.getpid()}) %(message)s")
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    conn = Client(spec["address"], family="AF_UNIX",
                  authkey=bytes.fromhex(os.environ.pop("VLLM_OMNI_RANK_AUTHKEY")))
    conn.send(rank)

    import diffusers
    import torch
    import torch.distributed as dist

    from vllm_omni.engine.diffusion.adapters import STEP_ADAPTERS
    from vllm_omni.engine.diffusion.parallel.driver import backend, bind_rank
    from vllm_omni.engine.diffusion.parallel.layout import Layout
    from vllm_omni.engine.diffusion.parallel.rank import RankRuntime
    from vllm_omni.engine.diffusion.quantize import quantize_weights

    device = spec["device"]
    bind_rank(spec["cores"], device)
    layout = Layout(*spec["layout"])
    store = dist.TCPStore("127.0.0.1", spec["store_port"], layout.world, is_master=False)
    dist.init_process_group(backend(device), store=store, rank=rank, world_size=layout.world,
                            timeout=timedelta(hours=2))
    try:
        root = Path(spec["model"])
        index = json.loads((root / "model_index.json").read_text())
        adapter = STEP_ADAPTERS[index["_class_name"]]
        transformer = getattr(diffusers, index["transformer"][1]).from_pretrained(
            root / "transformer", torch_dtype=getattr(torch, spec["dtype"])).to(device)
        if spec.get("quantization"):
            quantize_weights(transformer, spec["quantization"], device)
    except BaseException:
        conn.send(traceback.format_exc())
        return
    conn.send("ready")
    # Every rank creates the groups together once all have loaded (a collective).
    runtime = RankRuntime(layout, rank, transformer, adapter.transformer_spec,
                          adapter.modulated_input, torch.device(device))
    with torch.inference_mode():
        while True:
            try:
                call = conn.recv()
            except EOFError:
                return
            if call is None:
                return
            runtime.execute(call, None)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
