"""Whether the device's attention backend can run a stage's model. vLLM's CPU attention has
kernels for some head sizes only and finds out at the first request (the engine dies, every
request after it fails); the plan checks at start instead."""

from __future__ import annotations

from typing import Any


def attention_problems(stage: str, model_config: Any, device: str) -> list[str]:
    """What keeps the stage's decoder attention from running on `device` (empty: nothing).
    On GPUs vLLM picks a backend that supports the head size at start, or fails there."""
    if device != "cpu":
        return []
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    head = model_config.get_head_size()
    if CPUAttentionBackend.supports_head_size(head):
        return []
    sizes = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
    return [f"stage {stage!r}: its model's attention head size is {head}; vLLM's CPU "
            f"attention runs head sizes {sizes} only"]
