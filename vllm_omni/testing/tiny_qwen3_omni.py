"""A tiny Qwen3-Omni (MoE thinker -> MoE talker + code predictor -> code2wav), random weights.

Built from transformers' own Qwen3-Omni config and model classes and saved in the released
checkpoint's layout (config, safetensors, tokenizer, processor configs, chat template), so
vLLM's thinker and HF's `generate(return_audio=True)` read it like the real model. The
speakers live in the talker config (`speaker_id`), as in the release.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_omni.testing.tiny_omni import default_init, omni_tokenizer, save_processor
from vllm_omni.testing.tokenizer import chatml_template

# As for Qwen2.5-Omni (tiny_omni.INIT_STD): HF's std 0.02 leaves a tiny decoder's greedy output
# one token repeated whatever the prompt.
INIT_STD = 0.1

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
]
# HF's talker finds each turn's role by the one token after <|im_start|>: in the released
# vocabulary each role is one token, so here too (added tokens, matched before BPE).
ROLE_TOKENS = ["system", "user", "assistant"]

EXTRA_SPECIAL_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}

# Codec ids. The codebook is 0..CODEBOOK-1; HF's `generate` suppresses the talker vocab's top
# 1024 ids (all but codec eos), so the specials sit there, above the codebook, as released.
CODEBOOK = 64
TALKER_VOCAB = CODEBOOK + 1024
CODEC = {"codec_pad_id": 64, "codec_bos_id": 65, "codec_eos_token_id": 66,
         "codec_nothink_id": 67, "codec_think_bos_id": 68, "codec_think_eos_id": 69}
SPEAKERS = {"ethan": 70, "chelsie": 71, "aiden": 72}
CODE_GROUPS = 16
SAMPLE_RATE = 24000

OMNI_CHAT_TEMPLATE = chatml_template(
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] in ('audio', 'audio_url', 'input_audio') %}"
    "<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif part['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}"
)


def _token_ids(tokenizer) -> dict[str, int]:
    names = SPECIAL_TOKENS + ROLE_TOKENS
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in names}
    assert len(set(ids.values())) == len(ids), "special tokens must have distinct ids"
    return ids


def _decoder(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
             head_dim: int = 32) -> dict:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "intermediate_size": intermediate, "initializer_range": INIT_STD,
            "max_position_embeddings": 4096}


def _moe(experts: int, per_token: int, intermediate: int) -> dict:
    return {"num_experts": experts, "num_experts_per_tok": per_token,
            "moe_intermediate_size": intermediate, "decoder_sparse_step": 1}


def omni_config(ids: dict[str, int], vocab_size: int, dtype: str):
    """The tiny Qwen3OmniMoeConfig: the real structure (MoE decoders, deepstack vision,
    16 code groups, code2wav's real upsampling), every width shrunk. vLLM's CPU attention
    needs heads of 32 or more."""
    from transformers import Qwen3OmniMoeConfig

    media = {
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
    }
    # 3 layers, the talker reading the middle one's output: an intermediate layer, as the
    # released talker reads layer 18 of 48.
    text = {
        **_decoder(128, 3, heads=4, kv_heads=2, intermediate=256),
        **_moe(4, 2, 64),
        "vocab_size": vocab_size,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                            "mrope_section": [4, 6, 6], "mrope_interleaved": True},
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    audio = {"encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 128,
             "d_model": 64, "output_dim": text["hidden_size"], "downsample_hidden_size": 32,
             "initializer_range": INIT_STD}
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "out_hidden_size": text["hidden_size"], "num_position_embeddings": 64,
              "deepstack_visual_indexes": [0], "initializer_range": INIT_STD,
              # Undeclared, read by vLLM: the position grid's side times the patch.
              "image_size": 8 * 16, "apply_vit_abs_pos_embed": True}
    thinker = {
        "text_config": text, "audio_config": audio, "vision_config": vision, **media,
        "user_token_id": ids["user"],
        # Read by vLLM's thinker (not a declared field of the config class).
        "audio_end_token_id": ids["<|audio_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "initializer_range": INIT_STD,
    }
    talker_text = {
        **_decoder(64, 2, heads=2, kv_heads=1, intermediate=128),
        **_moe(4, 2, 32),
        # Not a declared field; the released config has it (the talker's shared expert).
        "shared_expert_intermediate_size": 64,
        "vocab_size": TALKER_VOCAB,
        # A low theta, so that positions change the codes.
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0,
                            "mrope_section": [4, 6, 6], "mrope_interleaved": True},
    }
    code_predictor = {
        **_decoder(64, 2, heads=2, kv_heads=1, intermediate=128),
        "vocab_size": CODEBOOK,
        "num_code_groups": CODE_GROUPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    talker = {
        "text_config": talker_text, "code_predictor_config": code_predictor,
        "num_code_groups": CODE_GROUPS, "thinker_hidden_size": text["hidden_size"],
        "accept_hidden_layer": 2, **CODEC, **media,
        "vision_start_token_id": ids["<|vision_start|>"],
        "spatial_merge_size": vision["spatial_merge_size"],  # undeclared; read by the talker
        "speaker_id": SPEAKERS, "initializer_range": INIT_STD,
    }
    code2wav = {
        "codebook_size": CODEBOOK, "hidden_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_quantizers": CODE_GROUPS, "decoder_dim": 64, "sliding_window": 72,
        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
        enable_audio_output=True, dtype=dtype,
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<|tts_pad|>"], tts_bos_token_id=ids["<|tts_bos|>"],
        tts_eos_token_id=ids["<|tts_eos|>"], system_token_id=ids["system"],
        user_token_id=ids["user"], assistant_token_id=ids["assistant"],
    )


def _init_talker_experts(model) -> None:
    """HF's init leaves the talker's router and experts as they were allocated (zeros, or
    whatever the memory held): every expert parameter gets the thinker's init here."""
    for name, param in model.talker.named_parameters():
        if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
            torch.nn.init.normal_(param, std=INIT_STD)


def build_qwen3_omni(out_dir: Path, seed: int, dtype: str) -> None:
    """Write the tiny Qwen3-Omni folder to `out_dir`."""
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    tokenizer = omni_tokenizer(seed, SPECIAL_TOKENS, EXTRA_SPECIAL_TOKENS, OMNI_CHAT_TEMPLATE,
                               added=tuple(ROLE_TOKENS))
    ids = _token_ids(tokenizer)
    config = omni_config(ids, len(tokenizer), dtype)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        _init_talker_experts(model)
        default_init(model.code2wav)
    model.to(getattr(torch, dtype))
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=ids["<|endoftext|>"])
    model.save_pretrained(out_dir)
    save_processor(out_dir, tokenizer, "Qwen3OmniMoeProcessor", patch_size=16,
                   size={"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 256})
