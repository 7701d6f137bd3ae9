"""LoRA adapters on a DiT, chosen per batch row: one copy of the base weights, many adapters.

An adapter is a diffusers / PEFT LoRA file, read by the pipeline's own `lora_state_dict`
(so every format diffusers' `load_lora_weights` reads is read the same way). Nothing is
merged into the weights: a forward hook on each linear layer an adapter targets adds
`scale * B(A(x))` to the rows of the batch whose request chose that adapter, so requests
with different adapters, and without one, share a transformer call.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass
class LoraLayer:
    down: torch.Tensor  # A: rank x in_features
    up: torch.Tensor  # B: out_features x rank
    scale: float  # lora_alpha / rank, as PEFT scales it


def _alpha(module: str, meta: dict[str, Any], rank: int) -> float:
    """The module's lora_alpha from the adapter's PEFT config (the rank without one, so the
    scale is 1: what diffusers assumes for a file that records no alpha)."""
    for pattern, alpha in (meta.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){re.escape(pattern)}$", module) or fnmatch.fnmatch(module, pattern):
            return float(alpha)
    return float(meta.get("lora_alpha") or rank)


def read_adapter(pipe: Any, path: str, model: nn.Module) -> dict[str, LoraLayer]:
    """The adapter at `path` as layers of `model` (the pipeline's transformer), checked
    against it: ValueError naming what does not fit."""
    if not Path(path).exists():
        raise ValueError(f"no LoRA adapter at {path!r}")
    try:
        state, meta = type(pipe).lora_state_dict(path, return_lora_metadata=True)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ValueError(f"{path!r} is not a LoRA file diffusers reads: {e}") from None
    meta = {k.removeprefix("transformer."): v for k, v in (meta or {}).items()}
    others = sorted({k.split(".")[0] for k in state if not k.startswith("transformer.")})
    if others:
        raise ValueError(f"the adapter at {path!r} has weights for {others}: only the "
                         "transformer's LoRA weights are served per request")
    use_rslora = bool(meta.get("use_rslora"))
    layers: dict[str, LoraLayer] = {}
    for key in state:
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise ValueError(f"the adapter at {path!r} holds {key!r}, which is not a "
                                 "LoRA A or B matrix (DoRA, biases and full layers are not "
                                 "served per request)")
            continue
        name = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
        down, up = state[key], state.get(key.replace(".lora_A.", ".lora_B."))
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"the adapter at {path!r} targets {name!r}, which this model "
                             "does not have") from None
        if not isinstance(module, nn.Linear):
            raise ValueError(f"the adapter at {path!r} targets {name!r}, a "
                             f"{type(module).__name__}: only linear layers take LoRA here")
        rank = down.shape[0]
        if (up is None or down.shape != (rank, module.in_features)
                or up.shape != (module.out_features, rank)):
            raise ValueError(
                f"the adapter at {path!r} does not fit {name!r} ({module.in_features} -> "
                f"{module.out_features}): A is {tuple(down.shape)}, B is "
                f"{None if up is None else tuple(up.shape)}")
        alpha = _alpha(name, meta, rank)
        weight = module.weight
        layers[name] = LoraLayer(
            down.to(weight.device, weight.dtype), up.to(weight.device, weight.dtype),
            alpha / (math.sqrt(rank) if use_rslora else rank))
    if not layers:
        raise ValueError(f"the adapter at {path!r} has no LoRA weights for the transformer")
    return layers


class LoraSet:
    """The adapters a transformer serves, by name, and the hooks that apply them."""

    def __init__(self, pipe: Any, model: nn.Module) -> None:
        self.pipe, self.model = pipe, model
        self.adapters: dict[str, dict[str, LoraLayer]] = {}
        self._hooks: dict[str, Any] = {}
        # Set for one transformer call: each row's (adapter, scale); then, for the rows the
        # layers now run on, either the one adapter they all use with each row's scale, or
        # (mixed rows) None, and each layer stacks its A and B per row as it runs.
        self._rows: list[tuple[str | None, float]] = []
        self._like: torch.Tensor | None = None
        self._keep: list[int] = []
        self._single: tuple[dict[str, LoraLayer], torch.Tensor] | None = None

    def load(self, name: str, path: str) -> None:
        if name in self.adapters:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        layers = read_adapter(self.pipe, path, self.model)
        for module_name in layers.keys() - self._hooks.keys():
            module = self.model.get_submodule(module_name)
            self._hooks[module_name] = module.register_forward_hook(self._hook(module_name))
        self.adapters[name] = layers

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"no adapter named {name!r} is loaded")
        del self.adapters[name]
        used = {m for layers in self.adapters.values() for m in layers}
        for module_name in self._hooks.keys() - used:
            self._hooks.pop(module_name).remove()

    def check(self, name: str | None) -> None:
        if name is not None and name not in self.adapters:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: "
                             f"{sorted(self.adapters)})")

    @contextlib.contextmanager
    def applied(self, rows: list[tuple[str | None, float]], like: torch.Tensor) -> Iterator[None]:
        """Within: each row of the transformer's batch gets its (adapter, scale)."""
        self._rows, self._like = rows, like
        self._select(list(range(len(rows))))
        try:
            yield
        finally:
            self._rows, self._keep, self._single = [], [], None

    @contextlib.contextmanager
    def narrowed(self, keep: list[int]) -> Iterator[None]:
        """Within: the layers run on the rows `keep` of the call's batch only (a block the
        step cache skips for the other rows)."""
        if not self._rows:
            yield
            return
        saved = self._keep, self._single
        self._select([self._keep[i] for i in keep])
        try:
            yield
        finally:
            self._keep, self._single = saved

    def _select(self, keep: list[int]) -> None:
        """The layers now run on rows `keep` of the call's batch."""
        names = {self._rows[r][0] for r in keep}
        self._keep, self._single = keep, None
        if len(names) == 1 and None not in names:
            scales = torch.tensor([self._rows[r][1] for r in keep], dtype=self._like.dtype,
                                  device=self._like.device)
            self._single = self.adapters[names.pop()], scales

    def _stack(self, module_name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `module_name`'s A (rows x rank x in) and scaled B (rows x out x rank) for
        each row now run (zeros for a row whose adapter leaves the layer alone, ranks padded
        with zeros to the largest); None when no row's adapter has the layer."""
        layers = [(self.adapters[name].get(module_name), scale) if name else (None, 0.0)
                  for name, scale in (self._rows[r] for r in self._keep)]
        present = [layer for layer, _ in layers if layer is not None]
        if not present:
            return None
        rank = max(layer.down.shape[0] for layer in present)
        fan_in, fan_out = present[0].down.shape[1], present[0].up.shape[0]
        like = present[0].down
        down = like.new_zeros(len(layers), rank, fan_in)
        up = like.new_zeros(len(layers), fan_out, rank)
        for i, (layer, scale) in enumerate(layers):
            if layer is not None:
                r = layer.down.shape[0]
                down[i, :r] = layer.down
                up[i, :, :r] = layer.up * (scale * layer.scale)
        return down, up

    def _hook(self, module_name: str):
        def add_delta(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            if not self._keep:
                return output
            x = args[0]
            if x.shape[0] != len(self._keep):
                raise RuntimeError(f"{module_name} ran on {x.shape[0]} rows in a batch of "
                                   f"{len(self._keep)}: its LoRA delta cannot be given per row")
            if self._single is not None:  # one adapter on every row: plain matmuls
                layers, scales = self._single
                layer = layers.get(module_name)
                if layer is None:
                    return output
                delta = (x @ layer.down.T) @ layer.up.T
                return output + delta * (scales * layer.scale).view(
                    -1, *[1] * (delta.dim() - 1))
            stacked = self._stack(module_name)  # each layer runs once per call
            if stacked is None:
                return output
            down, up = stacked
            rows = x.reshape(x.shape[0], -1, x.shape[-1])
            delta = torch.bmm(torch.bmm(rows, down.transpose(1, 2)), up.transpose(1, 2))
            return output + delta.view(output.shape)

        return add_delta
