"""Input processors between Qwen3-Omni's stages, and the talker's request defaults."""

from __future__ import annotations

from typing import Any

from vllm_omni.models.qwen3_omni.talker import user_positions
from vllm_omni.outputs import OmniRequestOutput

DEFAULT_SPEAKER = "ethan"  # HF's `generate` default


def thinker_to_talker(
    upstream: dict[str, OmniRequestOutput], prompt: Any, stage: Any, params: dict[str, Any]
) -> dict[str, Any]:
    """The talker's prompt: a placeholder per user-turn token (their rows are the thinker's),
    then the assistant's nine positions, whose codec part is nothink, think bos and eos, the
    speaker, codec pad and codec bos after three without one. Its step inputs are the
    thinker's rows (prompt and reply), passed on as their handle."""
    thinker = upstream["thinker"]
    if "hidden_states" not in thinker.tensor_handles:
        raise ValueError("the thinker stage must keep hidden states (hidden_states: true)")
    config = stage.info.model_config.hf_config
    ids = list(thinker.prompt_token_ids) + list(thinker.token_ids or [])[:-1]
    speaker = str((params.get("code2wav") or {}).get("speaker") or DEFAULT_SPEAKER).lower()
    if speaker not in config.speaker_id:
        raise ValueError(f"unknown voice {speaker!r}; this model has "
                         f"{sorted(config.speaker_id)}")
    pad = config.codec_pad_id
    codec = [pad] * (len(user_positions(ids, config)) + 3) + [
        config.codec_nothink_id, config.codec_think_bos_id, config.codec_think_eos_id,
        config.speaker_id[speaker], pad, config.codec_bos_id]
    talker = params.get("talker")
    greedy = getattr(talker, "temperature", 1.0) == 0
    seed = getattr(talker, "seed", None)
    return {
        "prompt_token_ids": codec,
        "step_inputs": {
            "tensors": thinker.tensor_handles["hidden_states"],
            "args": {"thinker_ids": ids, "greedy": greedy, "seed": 0 if seed is None else seed},
        },
    }


def talker_sampling(config: Any) -> dict[str, Any]:
    """The talker's request defaults, as HF's `generate` samples it: codec eos ends the
    speech; the top 1024 ids of its vocabulary (the codec's special codes and the voices)
    never come out."""
    vocab = config.text_config.vocab_size
    eos = config.codec_eos_token_id
    return {
        "temperature": 0.9,
        "top_k": 50,
        "top_p": 1.0,
        "repetition_penalty": 1.05,
        "max_tokens": 4096,
        "stop_token_ids": [eos],
        # The config's eos (a text token id, 0 in the tiny model) is no code: only codec eos
        # ends the speech.
        "ignore_eos": True,
        "allowed_token_ids": [*range(vocab - 1024), eos],
        "detokenize": False,
    }
