"""Train the built-in image model: a small Flux DiT that draws handwritten digits.

Random weights say nothing about image quality (and make step caching look better or worse
than it is), so the demo model is trained, on CPU, from data that ships with scikit-learn:
its 1,797 8x8 handwritten digits, upscaled to 32x32 dark ink on white. Prompts are
"a handwritten digit seven" / "a handwritten digit 7" (and "" for one sample in ten, so
true CFG with an empty negative prompt works).

Two phases, both plain PyTorch on diffusers' own model classes:
  1. an AutoencoderKL (2x down, 4 latent channels) learns to reconstruct the images;
  2. a FluxTransformer2DModel learns rectified flow (velocity noise - data) on the VAE's
     latents, conditioned through the pipeline's own (frozen, randomly initialised, seeded)
     CLIP and T5 text encoders.
The result is a FluxPipeline folder (transformer and VAE stored in fp16 to stay small) plus
training.json recording the seed, steps, losses and wall time.

    pip install scikit-learn
    python scripts/train_digits.py --out vllm_omni/assets/digits-flux
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SIZE = 32
TEXT_TOKENS = 32


def digit_images() -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's digits as 32x32 RGB in [-1, 1] (dark ink on white), with their labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    x = (1.0 - x.clamp(0, 1)) * 2 - 1
    return x.expand(-1, 3, -1, -1).contiguous(), torch.tensor(data.target)


def prompts_for(label: int) -> list[str]:
    return [f"a handwritten digit {WORDS[label]}", f"a handwritten digit {label}"]


def build_pipeline():
    from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel

    from vllm_omni.testing.tiny_diffusers import (
        _clip_text,
        _clip_tokenizer,
        _flow_scheduler,
        _t5,
        _t5_tokenizer,
    )

    clip_tok, t5_tok = _clip_tokenizer(), _t5_tokenizer()
    t5_tok.model_max_length = TEXT_TOKENS
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=16,
        sample_size=SIZE,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=6,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=False,
        axes_dims_rope=(8, 12, 12),
    )
    return FluxPipeline(
        scheduler=_flow_scheduler(dynamic=True),
        vae=vae,
        text_encoder=_clip_text(clip_tok, 32, with_projection=False),
        tokenizer=clip_tok,
        text_encoder_2=_t5(t5_tok, 32),
        tokenizer_2=t5_tok,
        transformer=transformer,
    )


def train_vae(vae, images: torch.Tensor, steps: int, log) -> list[float]:
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        batch = images[torch.randint(len(images), (64,))]
        posterior = vae.encode(batch).latent_dist
        recon = vae.decode(posterior.sample()).sample
        kl = posterior.kl().mean() / batch[0].numel()
        loss = F.mse_loss(recon, batch) + 1e-4 * kl
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            log(f"vae step {step} loss {loss.item():.5f}")
    return losses


def encode_texts(pipe, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    embeds, pooled, _ = pipe.encode_prompt(
        prompt=texts, prompt_2=None, device="cpu", max_sequence_length=TEXT_TOKENS
    )
    return embeds, pooled


def train_dit(pipe, latents, labels, steps: int, log) -> list[float]:
    """Rectified flow on the latents; the text encoders learn along (random, frozen ones give
    prompts too alike for the transformer to pick up the digit in a CPU-sized run)."""
    model = pipe.transformer
    texts = [""] + [p for d in range(10) for p in prompts_for(d)]
    n = len(latents)
    height = width = SIZE // pipe.vae_scale_factor
    packed = pipe._pack_latents(latents, n, latents.shape[1], height, width)
    img_ids = pipe._prepare_latent_image_ids(n, height // 2, width // 2, "cpu", torch.float32)
    txt_ids = torch.zeros(TEXT_TOKENS, 3)
    params = [*model.parameters(), *pipe.text_encoder.parameters(),
              *pipe.text_encoder_2.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 200) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    losses = []
    for step in range(steps):
        idx = torch.randint(n, (64,))
        x0 = packed[idx]
        # Text index: 0 is the empty prompt; label d has prompts 1 + 2d and 2 + 2d.
        text = 1 + 2 * labels[idx] + torch.randint(2, (64,))
        text = torch.where(torch.rand(64) < 0.1, torch.zeros_like(text), text)
        # Logit-normal, leaning to high noise, where the prompt decides the digit.
        sigma = torch.sigmoid(torch.randn(64) + 0.5)
        embeds, pooled = encode_texts(pipe, texts)
        noise = torch.randn_like(x0)
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        pred = model(
            hidden_states=xt,
            timestep=sigma,
            pooled_projections=pooled[text],
            encoder_hidden_states=embeds[text],
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 200 == 0 or step == steps - 1:
            log(f"dit step {step} loss {sum(losses[-200:]) / len(losses[-200:]):.4f} "
                f"prompt gain {prompt_gain(pipe, packed, labels, img_ids, texts):.3f}")
    return losses


@torch.no_grad()
def prompt_gain(pipe, packed, labels, img_ids, texts) -> float:
    """Loss at high noise with a wrong digit's prompt over the loss with the right one (a model
    that ignores its prompt scores 1.0)."""
    g = torch.Generator().manual_seed(0)
    idx = torch.arange(0, len(packed), len(packed) // 128)[:128]
    x0, label = packed[idx], labels[idx]
    noise = torch.randn(x0.shape, generator=g)
    xt = 0.1 * x0 + 0.9 * noise
    embeds, pooled = encode_texts(pipe, texts)
    losses = []
    for text in (1 + 2 * label, 1 + 2 * ((label + 3) % 10)):
        pred = pipe.transformer(
            hidden_states=xt, timestep=torch.full((len(idx),), 0.9),
            pooled_projections=pooled[text], encoder_hidden_states=embeds[text],
            txt_ids=torch.zeros(TEXT_TOKENS, 3), img_ids=img_ids, return_dict=False,
        )[0]
        losses.append(F.mse_loss(pred, noise - x0).item())
    return losses[1] / losses[0]


def _earlier_record(folder: str | None) -> dict | None:
    """The training record of the run this one continued (None for a run from scratch)."""
    if folder is None:
        return None
    path = Path(folder) / "training.json"
    return json.loads(path.read_text()) if path.is_file() else {"folder": folder}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="vllm_omni/assets/digits-flux")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vae-steps", type=int, default=600)
    ap.add_argument("--dit-steps", type=int, default=3000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init-from", default=None,
                    help="continue from an earlier run's folder: its VAE as is, its "
                    "transformer and text encoders trained further")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - started:7.1f}s] {msg}", flush=True)

    images, labels = digit_images()
    pipe = build_pipeline()

    if args.init_from:
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(args.init_from, dtype=torch.float32)
        pipe.tokenizer_2.model_max_length = TEXT_TOKENS
        vae_losses = [float("nan")] * 100
    else:
        vae_losses = train_vae(pipe.vae, images, args.vae_steps, log)
    vae_seconds = time.time() - started
    pipe.vae.requires_grad_(False)
    with torch.no_grad():
        z = torch.cat([pipe.vae.encode(b).latent_dist.mean for b in images.split(256)])
    # The pipeline un-does this before decoding: latents / scaling + shift.
    shift, scale = z.mean().item(), 1.0 / z.std().item()
    pipe.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    latents = (z - shift) * scale

    dit_losses = train_dit(pipe, latents, labels, args.dit_steps, log)
    out = Path(args.out)
    # fp16 on disk keeps the folder small; it loads as float32.
    pipe.transformer.to(torch.float16)
    pipe.vae.to(torch.float16)
    pipe.save_pretrained(out)
    record = {
        "seed": args.seed,
        "data": "sklearn.datasets.load_digits, 1797 images, 8x8 -> 32x32 bilinear",
        "vae_steps": args.vae_steps,
        "vae_final_loss": sum(vae_losses[-100:]) / 100,
        "dit_steps": args.dit_steps,
        "dit_final_loss": sum(dit_losses[-200:]) / 200,
        "continued_from": _earlier_record(args.init_from),
        "batch_size": 64,
        "seconds": {"vae": round(vae_seconds), "total": round(time.time() - started)},
        "threads": args.threads,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": f"python scripts/train_digits.py --seed {args.seed} "
        f"--vae-steps {args.vae_steps} --dit-steps {args.dit_steps}",
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    log(f"saved to {out}")


if __name__ == "__main__":
    main()
