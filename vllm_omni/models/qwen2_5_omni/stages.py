"""Input processors between Qwen2.5-Omni's stages."""

from __future__ import annotations

from typing import Any

from vllm_omni.models.qwen2_5_omni.speakers import speaker_bos
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.processors import reply_start


def thinker_to_talker(
    upstream: dict[str, OmniRequestOutput], prompt: Any, stage: Any, params: dict[str, Any]
) -> dict[str, Any]:
    """The talker's prompt: one codec mask per thinker prompt token, then codec pad and
    codec bos; its step inputs are the thinker's states, passed on as their handle. The voice
    is the code2wav stage's `speaker` (its text bos token starts the talker's text)."""
    thinker = upstream["thinker"]
    if "hidden_states" not in thinker.tensor_handles:
        raise ValueError("the thinker stage must keep hidden states (hidden_states: true)")
    config = stage.info.model_config.hf_config
    # A written answer at the prompt's end (text to speech) is spoken as the thinker's reply.
    prompt_ids = list(thinker.prompt_token_ids)
    prompt_ids = prompt_ids[:reply_start(params.get("thinker"), len(prompt_ids))]
    codec = [config.tts_codec_mask_token_id] * len(prompt_ids)
    codec += [config.tts_codec_pad_token_id, config.tts_codec_start_token_id]
    return {
        "prompt_token_ids": codec,
        "step_inputs": {
            "tensors": thinker.tensor_handles["hidden_states"],
            "args": {
                "thinker_prompt": prompt_ids,
                "text_bos": speaker_bos(
                    stage.info.model_config.model, (params.get("code2wav") or {}).get("speaker")
                ),
            },
        },
    }


def talker_sampling(config: Any) -> dict[str, Any]:
    """The talker's request defaults, as HF's `generate` samples it: codec eos or pad end
    the speech, codec bos never comes out, a light repetition penalty."""
    bos = config.tts_codec_start_token_id
    return {
        "temperature": 0.9,
        "top_k": 40,
        "top_p": 0.8,
        "repetition_penalty": 1.05,
        "max_tokens": 4096,
        "stop_token_ids": [config.tts_codec_end_token_id, config.tts_codec_pad_token_id],
        "allowed_token_ids": [i for i in range(config.vocab_size) if i != bos],
        "detokenize": False,
    }


def talker_to_code2wav(
    upstream: dict[str, OmniRequestOutput], prompt: Any, stage: Any, params: dict[str, Any]
) -> dict[str, Any]:
    """The codes so far, up to (not with) the first codec eos or pad, which end the speech.

    Also called on the talker's unfinished outputs (a streamed edge): vLLM keeps the stop token
    among the outputs, and the token list of an unfinished output can already hold it."""
    talker = upstream["talker"]
    codes = list(talker.token_ids or [])
    if talker.finished and codes and talker.outputs[0].finish_reason == "stop":
        codes = codes[:-1]  # a stop token (or the model's eos) ended it
    talker_params = params.get("talker")
    stops = set(getattr(talker_params, "stop_token_ids", None) or [])
    for i, code in enumerate(codes):
        if code in stops:
            return {"codes": codes[:i]}
    return {"codes": codes}
