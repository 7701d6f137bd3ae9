"""Tiny diffusers pipelines (Flux, SD3, Qwen-Image and Qwen-Image-Edit, PixArt-Sigma, Sana,
Wan) with random weights.

Built from the real component classes, saved with `save_pretrained`, and loaded back through
`DiffusionPipeline.from_pretrained` like a downloaded model. Tokenizers are character-level
vocabularies made here, so nothing is downloaded.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import torch

_CHARS = string.ascii_lowercase + string.digits + string.punctuation


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    # CLIP's BPE marks word ends with "</w>": every character exists in both forms.
    pieces = specials + list(_CHARS) + [c + "</w>" for c in _CHARS]
    vocab = {p: i for i, p in enumerate(pieces)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _t5_tokenizer():
    from transformers import T5Tokenizer

    pieces = ["<pad>", "</s>", "<unk>", "\u2581"] + list(_CHARS)
    pieces += ["\u2581" + c for c in _CHARS]
    return T5Tokenizer(vocab=[(p, -1.0) for p in pieces], extra_ids=0)


def _qwen_tokenizer(extra_special: list[str] = ()):
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    pieces = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=1024)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *extra_special]})
    return tok


def _clip_text(tokenizer, hidden: int, with_projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(config)


def _t5(tokenizer, d_model: int):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_ff=2 * d_model,
        d_kv=8,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
    )
    return T5EncoderModel(config)


def _vae(latent_channels: int, shift: float, scale: float):
    from diffusers import AutoencoderKL

    # Four blocks: the real 8x spatial compression, with 8 channels each.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        shift_factor=shift,
        scaling_factor=scale,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _flow_scheduler(dynamic: bool):
    from diffusers import FlowMatchEulerDiscreteScheduler

    if dynamic:
        return FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_image_seq_len=256,
            max_image_seq_len=4096,
            base_shift=0.5,
            max_shift=1.15,
        )
    return FlowMatchEulerDiscreteScheduler(shift=3.0)


@dataclass(frozen=True)
class FluxSize:
    head_dim: int
    heads: int
    double_blocks: int
    single_blocks: int
    text_dim: int
    rope: tuple[int, int, int]


FLUX_SIZES = {
    "flux-tiny": FluxSize(16, 2, 1, 1, 32, (4, 6, 6)),
    # Hidden 384 and 8 blocks: the transformer dominates the time on a CPU.
    "flux-small": FluxSize(64, 6, 2, 6, 64, (16, 24, 24)),
}


def build_flux(size: FluxSize):
    from diffusers import FluxPipeline, FluxTransformer2DModel

    clip_tok, t5_tok = _clip_tokenizer(), _t5_tokenizer()
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=size.double_blocks,
        num_single_layers=size.single_blocks,
        attention_head_dim=size.head_dim,
        num_attention_heads=size.heads,
        joint_attention_dim=size.text_dim,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=size.rope,
    )
    return FluxPipeline(
        scheduler=_flow_scheduler(dynamic=True),
        vae=_vae(4, shift=0.1159, scale=0.3611),
        text_encoder=_clip_text(clip_tok, 32, with_projection=False),
        tokenizer=clip_tok,
        text_encoder_2=_t5(t5_tok, size.text_dim),
        tokenizer_2=t5_tok,
        transformer=transformer,
    )


def build_sd3():
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    clip_tok, t5_tok = _clip_tokenizer(), _t5_tokenizer()
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,
    )
    return StableDiffusion3Pipeline(
        scheduler=_flow_scheduler(dynamic=False),
        vae=_vae(4, shift=0.0609, scale=1.5305),
        text_encoder=_clip_text(clip_tok, 32, with_projection=True),
        tokenizer=clip_tok,
        text_encoder_2=_clip_text(_clip_tokenizer(), 32, with_projection=True),
        tokenizer_2=_clip_tokenizer(),
        # SD3 pads the CLIP features to the T5 width: T5 must be at least 32 + 32 wide.
        text_encoder_3=_t5(t5_tok, 64),
        tokenizer_3=t5_tok,
        transformer=transformer,
    )


def build_qwen_image(tokenizer=None, vision_token_ids: dict[str, int] | None = None, vae=None):
    """Qwen-Image; `vision_token_ids` (image_token_id, ...) for a tokenizer that has the
    vision placeholders (the edit model's)."""
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = tokenizer or _qwen_tokenizer()
    # Head dim 32: the smallest vLLM's CPU attention takes (the encoder runs on vLLM too).
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
        "bos_token_id": None,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
    }
    vision_config = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                     "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2}
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=text_config,
            vision_config=vision_config,
            bos_token_id=None,
            eos_token_id=text_config["eos_token_id"],
            **(vision_token_ids or {}),
        )
    )
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=64,
        axes_dims_rope=(4, 6, 6),
    )
    vae = vae or AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    return QwenImagePipeline(
        scheduler=_flow_scheduler(dynamic=True),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


# Qwen-Image-Edit's vision placeholders (the names of the released tokenizer): its prompt
# template holds one image in <|vision_start|><|image_pad|><|vision_end|>.
QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# A few hundred image pixels per placeholder: the edit pipeline hands the encoder an image
# of a 1024 x 1024 area, which the processor shrinks to at most this many pixels, so the
# tiny vision tower sees a dozen or so merged patches.
QWEN_EDIT_MAX_PIXELS = 28 * 28 * 16


def build_qwen_image_edit():
    """Qwen-Image-Edit (QwenImageEditPipeline): Qwen-Image's parts with a text encoder whose
    vision tower sees the input image (through the folder's Qwen2-VL processor), and a
    transformer that takes the image's latents beside the noise."""
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline
    from transformers import Qwen2VLProcessor

    from vllm_omni.compat.torchvision_free import install

    # Without torchvision, transformers has no Qwen2-VL video processor, which the
    # processor always holds (the released folder has its config too): the compat one.
    install()
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = _qwen_tokenizer(QWEN_VL_TOKENS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_TOKENS}
    # The pipeline VAE-encodes the input image at a 1024 x 1024 area whatever the output
    # size: half the channels and no residual blocks keep that to about a second on a CPU.
    vae = AutoencoderKLQwenImage(
        base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=0,
        temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )
    parts = build_qwen_image(tokenizer, {
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }, vae=vae).components
    # With its default init the tiny transformer attends almost uniformly over the thousands
    # of image tokens, so its prediction hardly depends on the input image (changes of 1e-3
    # in the latents, 1e-6 in pixels): a parity test would compare nothing. Sharper
    # attention (the query / key RMS-norm scales x4) makes it move by 0.1.
    with torch.no_grad():
        for name, param in parts["transformer"].named_parameters():
            if name.rsplit(".", 2)[-2] in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
                param.mul_(4.0)
    # The PIL backend: torchvision is needed neither to build nor to load it.
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": QWEN_EDIT_MAX_PIXELS},
        patch_size=14, temporal_patch_size=2, merge_size=2,
    )
    video_processor = Qwen2VLVideoProcessor(
        size={"shortest_edge": 56 * 56, "longest_edge": QWEN_EDIT_MAX_PIXELS})
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=video_processor)
    return QwenImageEditPipeline(**parts, processor=processor)


def build_pixart_sigma():
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    t5_tok = _t5_tokenizer()
    transformer = PixArtTransformer2DModel(
        sample_size=8,
        num_layers=2,
        patch_size=2,
        attention_head_dim=8,
        num_attention_heads=4,
        in_channels=4,
        out_channels=8,  # learned sigma: twice the latent channels
        caption_channels=32,
        cross_attention_dim=32,
        norm_type="ada_norm_single",
        use_additional_conditions=False,
    )
    return PixArtSigmaPipeline(
        tokenizer=t5_tok,
        text_encoder=_t5(t5_tok, 32),
        vae=_vae(4, shift=0.0, scale=0.13025),
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(),
    )


def build_sana():
    from diffusers import (
        AutoencoderDC,
        FlowMatchEulerDiscreteScheduler,
        SanaPipeline,
        SanaTransformer2DModel,
    )
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma2Config, Gemma2Model, GemmaTokenizerFast

    pieces = ["<pad>", "<eos>", "<bos>", "<unk>"] + sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = GemmaTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", padding_side="right")
    text_encoder = Gemma2Model(Gemma2Config(
        vocab_size=len(pieces), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    ))
    transformer = SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=8,
        cross_attention_dim=16, caption_channels=32, sample_size=8, patch_size=1,
    )
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=[1, 1],
        downsample_block_type="conv", upsample_block_type="interpolate",
        decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407,
    )
    return SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                        transformer=transformer,
                        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


def build_wan():
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    t5_tok = _t5_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(t5_tok), d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0,
    ))
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True],
                           latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    return WanPipeline(tokenizer=t5_tok, text_encoder=text_encoder, vae=vae,
                       transformer=transformer, scheduler=_flow_scheduler(dynamic=False))


def build_wan_i2v():
    """Wan 2.1 image-to-video: the text-to-video parts, a CLIP vision encoder for the input
    image, and a transformer that takes the image's latents (plus a mask) beside the noise."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    parts = build_wan().components
    z_dim = parts["vae"].config.z_dim
    parts["transformer"] = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
        # noise, the image's latents, and a mask of 4 frames per latent frame
        in_channels=2 * z_dim + 4, out_channels=z_dim, text_dim=32, freq_dim=32, ffn_dim=32,
        num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32, image_dim=16, added_kv_proj_dim=24,
    )
    image_encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8, projection_dim=16,
    ))
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32,
                                                                          "width": 32})
    return WanImageToVideoPipeline(**parts, image_encoder=image_encoder.eval(),
                                   image_processor=processor)


def build_diffusers(name: str, out_dir: Path, seed: int, dtype: str) -> None:
    torch.manual_seed(seed)
    if name in FLUX_SIZES:
        pipe = build_flux(FLUX_SIZES[name])
    elif name == "sd3-tiny":
        pipe = build_sd3()
    elif name == "sd3-img2img-tiny":
        from diffusers import StableDiffusion3Img2ImgPipeline

        # An image-to-image pipeline over the same components: an edit model for tests.
        pipe = StableDiffusion3Img2ImgPipeline(**build_sd3().components)
    elif name == "qwen-image-tiny":
        pipe = build_qwen_image()
    elif name == "qwen-image-edit-tiny":
        pipe = build_qwen_image_edit()
    elif name == "pixart-sigma-tiny":
        pipe = build_pixart_sigma()
    elif name == "sana-tiny":
        pipe = build_sana()
    elif name == "wan-tiny":
        pipe = build_wan()
    elif name == "wan-i2v-tiny":
        pipe = build_wan_i2v()
    else:
        raise ValueError(f"unknown tiny diffusers pipeline {name!r}")
    if dtype != "float32":
        pipe.to(getattr(torch, dtype))
    pipe.save_pretrained(out_dir)


DIFFUSERS_MODELS = [*FLUX_SIZES, "sd3-tiny", "sd3-img2img-tiny", "qwen-image-tiny",
                    "qwen-image-edit-tiny", "pixart-sigma-tiny", "sana-tiny", "wan-tiny",
                    "wan-i2v-tiny"]
