"""A tiny Qwen2.5-Omni (thinker -> talker -> token2wav) with random weights.

Built from transformers' own Qwen2.5-Omni config and model classes and saved in the layout of
the released checkpoint (config, safetensors, tokenizer, processor configs, chat template,
`spk_dict.pt`), so vLLM's thinker and HF's talker and token2wav read it like the real model.
Nothing is downloaded: the tokenizer is trained here, the speakers are random tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from vllm_omni.testing.tokenizer import chatml_template, train_tokenizer

THINKER_VOCAB = 1024
# HF's init (normal, std 0.02) leaves a 2-layer model nearly the identity on the embeddings: its
# greedy output was one token repeated, whatever the prompt, so a parity test would compare
# nothing. With std 0.1 the output depends on the context and the top-1/top-2 logit margins
# (0.03-0.3) stay far above fp32 rounding.
INIT_STD = 0.1

# The real special-token names: the processor and vLLM find the multimodal placeholders by
# these strings. The tts and speaker tokens have no name in the released tokenizer (only ids);
# they are named here so that the tiny vocab reserves ids that text never produces.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eod|>",
    "<|spk_chelsie|>",
    "<|spk_ethan|>",
]

# Qwen2.5-Omni's processor reads these as tokenizer attributes (`tokenizer.image_token`, ...).
EXTRA_SPECIAL_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}

SPEAKERS = {"Chelsie": "<|spk_chelsie|>", "Ethan": "<|spk_ethan|>"}

# Talker (codec) vocabulary: codes 0..111 are the codebook, the special codes sit above it as in
# the real model (8192 codes, pad 8292, bos 8293, eos 8294, mask 8296, vocab 8448).
TALKER_VOCAB = 128
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 112, 113, 114, 116
# HF's `generate` defaults `talker_eos_token_id` to the real ids [8292, 8294], which lie
# outside this vocab: callers pass these instead.
TALKER_EOS_IDS = [CODEC_PAD, CODEC_EOS]

MEL_DIM = 80
SAMPLE_RATE = 24000
# BigVGAN upsamples each mel frame by the product of these: 240 samples, 10 ms at 24 kHz.
UPSAMPLE_RATES = [5, 3, 2, 2, 2, 2]

# ChatML with Qwen2.5-Omni's multimodal placeholders: one placeholder token per item, which the
# processor (HF or vLLM) expands to the item's number of embeddings.
OMNI_CHAT_TEMPLATE = chatml_template(
    "{% if part['type'] in ('image', 'image_url') %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif part['type'] in ('audio', 'audio_url', 'input_audio') %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif part['type'] in ('video', 'video_url') %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}"
)


def omni_tokenizer(seed: int, special_tokens: list[str], extra_special_tokens: dict[str, str],
                   chat_template: str, added: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A trained tokenizer with an omni model's special tokens (and `added` plain tokens,
    matched before BPE). Re-wrapped so that `extra_special_tokens` is part of the saved
    tokenizer config: that is where the processor looks up `image_token`, `audio_token`, ...
    when it loads."""
    trained = train_tokenizer(THINKER_VOCAB, special_tokens, seed=seed)
    if added:
        trained.add_tokens(list(added))
    return PreTrainedTokenizerFast(
        tokenizer_object=trained.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=extra_special_tokens,
        chat_template=chat_template,
        model_max_length=32768,
    )


def _token_ids(tokenizer) -> dict[str, int]:
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(ids), "special tokens must have distinct ids"
    return ids


def _decoder_shape(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                   head_dim: int | None = None) -> dict:
    return {"hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim or hidden // heads}


TINY = {
    "thinker": _decoder_shape(128, 256, 2, heads=4, kv_heads=2),
    "talker": _decoder_shape(64, 128, 2, heads=2, kv_heads=1),  # vLLM's CPU attention: >= 32
    "audio": {"encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 128,
              "d_model": 64},
    "vision": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
               "fullatt_block_indexes": [1]},
    "dit": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "head_dim": 16, "emb_dim": 32, "look_ahead_layers": [1], "look_backward_layers": [0],
            "enc_emb_dim": 32, "enc_dim": 32, "enc_channels": [32, 32, 32, 32, 96],
            "enc_attention_channels": 16, "enc_se_channels": 16},
    # Halved by each of the 6 upsamples: 2 channels at the end.
    "bigvgan": {"upsample_initial_channel": 128, "resblock_kernel_sizes": [3, 7],
                "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5]]},
}
# Each component's widths and depths. "tiny" for tests; "small": the thinker and talker
# wider and deeper (about 20M parameters), the rest tiny; "scaled": the released 7B's depths
# with every width divided by 7 (heads at least 32 wide, for vLLM's CPU attention), so that
# each stage's share of the compute is the real model's. The 7B's own shapes are those of
# transformers' config defaults, except its talker (hidden 896, 24 layers, 12 heads of 128,
# 4 kv heads) and its encoders (1280 wide).
SIZES = {
    "tiny": TINY,
    "small": {**TINY, "thinker": _decoder_shape(512, 1536, 4, heads=4, kv_heads=2),
              "talker": _decoder_shape(256, 768, 4, heads=2, kv_heads=1)},
    "scaled": {
        "vocab_size": 152064 // 7,
        "thinker": _decoder_shape(512, 18944 // 7, 28, heads=16, kv_heads=2),
        "talker": _decoder_shape(128, 18944 // 7, 24, heads=6, kv_heads=2, head_dim=32),
        "audio": {"encoder_layers": 32, "encoder_attention_heads": 11,
                  "encoder_ffn_dim": 5120 // 7, "d_model": 176},
        "vision": {"depth": 32, "hidden_size": 176, "intermediate_size": 3420 // 7,
                   "num_heads": 11, "fullatt_block_indexes": [7, 15, 23, 31]},
        "dit": {"hidden_size": 144, "num_hidden_layers": 22, "num_attention_heads": 9,
                "head_dim": 16, "emb_dim": 72, "look_ahead_layers": [10],
                "look_backward_layers": [0, 20], "enc_emb_dim": 28, "enc_dim": 18,
                "enc_channels": [36, 36, 36, 36, 108], "enc_attention_channels": 9,
                "enc_se_channels": 9},
        "bigvgan": {"upsample_initial_channel": 224, "resblock_kernel_sizes": [3, 7, 11],
                    "resblock_dilation_sizes": [[1, 3, 5]] * 3},
    },
}


def _mrope_section(head_dim: int) -> list[int]:
    unit = head_dim // 16  # mrope_section splits head_dim / 2 into (time, height, width)
    return [unit * 2, unit * 3, unit * 3]


def omni_config(ids: dict[str, int], vocab_size: int, dtype: str, size: str = "tiny"):
    """The tiny Qwen2_5OmniConfig: the real structure, every width shrunk."""
    from transformers import Qwen2_5OmniConfig

    multimodal_ids = {
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
    }
    shape = SIZES[size]
    thinker, talker = shape["thinker"], shape["talker"]
    text_config = {
        **thinker,
        # The tokenizer's tokens, padded like the real vocabulary where the size asks.
        "vocab_size": max(vocab_size, shape.get("vocab_size", 0)),
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                            "mrope_section": _mrope_section(thinker["head_dim"])},
        "tie_word_embeddings": False,
        "initializer_range": INIT_STD,
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    audio_config = {
        "num_mel_bins": 128,  # what the Whisper feature extractor produces
        **shape["audio"],
        "output_dim": text_config["hidden_size"],
    }
    vision_config = {
        **shape["vision"],
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": text_config["hidden_size"],
    }
    thinker_config = {
        "text_config": text_config,
        "audio_config": audio_config,
        "vision_config": vision_config,
        **multimodal_ids,
        # Not declared fields of the thinker config, but HF's rope-index code reads
        # `vision_start_token_id` from it and vLLM reads the vision token ids.
        "vision_token_id": ids["<|vision_pad|>"],
        "initializer_range": INIT_STD,
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    talker_config = {
        **multimodal_ids,
        "vocab_size": TALKER_VOCAB,
        "tts_text_start_token_id": ids["<|tts_bos|>"],
        "tts_text_end_token_id": ids["<|tts_eod|>"],
        "tts_text_pad_token_id": ids["<|tts_pad|>"],
        "tts_codec_start_token_id": CODEC_BOS,
        "tts_codec_end_token_id": CODEC_EOS,
        "tts_codec_pad_token_id": CODEC_PAD,
        "tts_codec_mask_token_id": CODEC_MASK,
        "embedding_size": text_config["hidden_size"],  # it reads the thinker's embeddings
        **talker,
        "max_position_embeddings": 4096,
        # A low theta, so that positions (multimodal RoPE ones too) change the codes.
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0,
                            "mrope_section": _mrope_section(talker["head_dim"])},
        "spatial_merge_size": vision_config["spatial_merge_size"],
        "initializer_range": INIT_STD,
        "pad_token_id": CODEC_PAD,
    }
    dit_config = {
        **shape["dit"],
        "ff_mult": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        # The codec embedding covers the whole talker vocab, not only the codebook: a random
        # talker emits special codes too, and the real size (8193) would index out of range.
        "num_embeds": TALKER_VOCAB,
        "mel_dim": MEL_DIM,
    }
    bigvgan_config = {
        "mel_dim": MEL_DIM,
        **shape["bigvgan"],
        "upsample_rates": UPSAMPLE_RATES,
        "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
    }
    return Qwen2_5OmniConfig(
        thinker_config=thinker_config,
        talker_config=talker_config,
        token2wav_config={"dit_config": dit_config, "bigvgan_config": bigvgan_config},
        enable_audio_output=True,
        dtype=dtype,
    )


def default_init(module: torch.nn.Module) -> None:
    """PyTorch's default init for the linear, conv and embedding layers of `module`.

    HF's init (normal, std 0.02) shrinks the signal at every vocoder layer (the waveform comes
    out around 1e-7): with the default init, codes move the waveform as they should. For
    Qwen2.5-Omni's token2wav it also keeps the DiT's code embedding strong enough to matter
    (with HF's, the waveform was the diffusion noise alone, the same for any codes).
    """
    layers = torch.nn.Linear | torch.nn.Conv1d | torch.nn.ConvTranspose1d | torch.nn.Embedding
    for child in module.modules():
        if isinstance(child, layers):
            child.reset_parameters()


def _speakers(ids: dict[str, int], config) -> dict[str, dict[str, Any]]:
    """`spk_dict.pt`: per speaker the talker's text-bos token, a DiT speaker embedding and a
    reference mel. HF's `from_pretrained` refuses a folder without it."""
    dit = config.token2wav_config.dit_config
    return {
        name: {
            "bos_token": ids[token],
            "cond": torch.randn(dit.enc_emb_dim),
            "ref_mel": torch.randn(1, 48, dit.mel_dim),
        }
        for name, token in SPEAKERS.items()
    }


def save_processor(out_dir: Path, tokenizer, processor_class: str, patch_size: int,
                   size: dict[str, int]) -> None:
    """Processor files as the released omni models have them.

    The Whisper feature extractor and the Qwen2-VL image processor both save to
    `preprocessor_config.json`; saving one after the other would keep only the second, so the
    two dicts are merged into one file. The image processor is the PIL backend: torchvision is
    not needed to build or load it. No video processor config is written (the released models
    have none either); transformers 5.19 has Qwen2-VL's video processor only for torchvision.
    """
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    feature_extractor = WhisperFeatureExtractor(
        feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400
    )
    image_processor = Qwen2VLImageProcessorPil(
        size=size, patch_size=patch_size, temporal_patch_size=2, merge_size=2,
    )
    merged = {
        **feature_extractor.to_dict(),
        **image_processor.to_dict(),
        "feature_extractor_type": "WhisperFeatureExtractor",
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor_class,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(merged, indent=2, sort_keys=True))
    tokenizer.save_pretrained(out_dir)  # with its chat template (chat_template.jinja)


def build_qwen2_5_omni(out_dir: Path, seed: int, dtype: str, size: str = "tiny") -> None:
    """Write the tiny Qwen2.5-Omni folder (about 7 MB, 1.76M parameters; "small": thinker
    and talker wider and deeper; "scaled": the 7B's proportions, see SIZES) to `out_dir`."""
    from transformers import GenerationConfig, Qwen2_5OmniForConditionalGeneration

    tokenizer = omni_tokenizer(seed, SPECIAL_TOKENS, EXTRA_SPECIAL_TOKENS, OMNI_CHAT_TEMPLATE)
    ids = _token_ids(tokenizer)
    config = omni_config(ids, len(tokenizer), dtype, size)
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    default_init(model.token2wav)
    # token2wav stays in fp32: HF runs it in fp32 whatever the model's dtype.
    model.thinker.to(getattr(torch, dtype))
    model.talker.to(getattr(torch, dtype))
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=ids["<|endoftext|>"])
    model.save_pretrained(out_dir)
    torch.save(_speakers(ids, config), out_dir / "spk_dict.pt")
    save_processor(out_dir, tokenizer, "Qwen2_5OmniProcessor", patch_size=14,
                   size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 256})
