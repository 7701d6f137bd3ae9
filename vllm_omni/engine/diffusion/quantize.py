"""Quantized DiT weights (engine option `quantization`), through torchao.

Weight-only: each linear layer of the transformer keeps its weight in 8 bits with a scale
per output row and computes in the stage's dtype, so activations, the text encoders and the
VAE stay as they are. LoRA hooks still see `nn.Linear` modules of the same shapes.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATIONS = ("int8", "fp8")
# vLLM's `--quantization` names for the same weight formats: the CLI flag reaches diffusion
# stages under them.
VLLM_NAMES = {"int8_per_channel_weight_only": "int8", "fp8": "fp8"}


def check_quantization(method: str | None, device: str) -> None:
    """ValueError for a method this engine does not know, or one the device cannot run."""
    if method is None:
        return
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {method!r}")
    if method == "fp8" and not device.startswith("cuda"):
        raise ValueError(f"fp8 weights need a CUDA GPU (compute capability 8.9 or newer); "
                         f"this stage runs on {device}: use int8")


def quantize_weights(model: nn.Module, method: str, device: str) -> None:
    """Quantize `model`'s linear weights in place, on `device`."""
    try:
        from torchao.quantization import (
            Float8WeightOnlyConfig,
            Int8WeightOnlyConfig,
            quantize_,
        )
    except ImportError as e:
        raise ValueError(f"quantization {method!r} needs torchao ({e})") from None
    if method == "fp8" and torch.cuda.get_device_capability(torch.device(device)) < (8, 9):
        raise ValueError(f"fp8 weights need compute capability 8.9 or newer; {device} has "
                         f"{torch.cuda.get_device_capability(torch.device(device))}: use int8")
    quantize_(model, Float8WeightOnlyConfig() if method == "fp8" else Int8WeightOnlyConfig())


def quantized_bytes(weights: int, itemsize: int, method: str | None) -> int:
    """The bytes of weights stored at `itemsize` per value once quantized: one byte per
    value (the per-row scales and the few non-linear parameters are not worth counting)."""
    return weights if method is None else weights // itemsize
