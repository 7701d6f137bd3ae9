"""LoRA files for tiny diffusers pipelines, made as a user's training run makes them: PEFT
adapters on the pipeline's transformer, saved by the pipeline's `save_lora_weights` with
their PEFT config (so rank and alpha travel in the file)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_lora(model: str | Path, out: str | Path, seed: int, rank: int = 4,
              alpha: float | None = None,
              targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "proj_out")) -> Path:
    """An adapter for the pipeline at `model`, with random A and B (a freshly initialised
    adapter's B is zero, which would change nothing), saved in `out`."""
    from diffusers import DiffusionPipeline
    from peft import LoraConfig, get_peft_model_state_dict

    pipe = DiffusionPipeline.from_pretrained(model)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(targets))
    pipe.transformer.add_adapter(config, adapter_name="trained")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pipe.transformer.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    layers = get_peft_model_state_dict(pipe.transformer, adapter_name="trained")
    out = Path(out)
    type(pipe).save_lora_weights(out, transformer_lora_layers=layers,
                                 transformer_lora_adapter_metadata=config.to_dict())
    return out
