"""Qwen2.5-Omni's talker as a vLLM model: codec tokens from the thinker's states.

The talker is a Qwen2 decoder whose input at each position is the thinker's contribution
(for the prompt: the thinker's last hidden state plus its input embedding per prompt token;
then one reply token's per step) plus the embedding of the codec token at that position,
projected from the thinker's width to the talker's. The thinker's part varies per request and
per step, so it comes as a per-request table indexed by position (`StepTable`), which the
step-inputs worker (vllm_omni.engine.ar.step_inputs) hands to `forward` through `step_inputs`.

The stage loads the Omni folder with `talker_hf_config` as `hf_overrides`, so vLLM sees the
talker's own config (and this architecture); weights come from `talker.*`, plus the few
thinker embedding rows the talker's input needs (text bos per speaker, text eos, text pad).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.qwen2 import Qwen2Model
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper
from vllm.sequence import IntermediateTensors

from vllm_omni.models.qwen2_5_omni.speakers import SPEAKERS_FILE, speakers
from vllm_omni.models.qwen2_5_omni.talker_decoder import TalkerDecoderLayer

ARCHITECTURE = "Qwen2_5OmniTalkerForCodecGeneration"
ROPE_KEY = "omni_decoder_rope_parameters"


def talker_hf_config(config: PretrainedConfig) -> PretrainedConfig:
    """`hf_overrides` of the talker stage: the Omni config -> its talker config.

    Positions: the talker's multimodal RoPE positions are the thinker's (its prompt's, then
    offset text positions), which come with the step inputs; vLLM itself hands the model plain
    token indices, so the config it sees has plain RoPE and the decoder gets the sections
    back (`ROPE_KEY`)."""
    talker = getattr(config, "talker_config", None)
    if talker is None:  # vLLM also calls this on a stand-in config to probe the model type
        return config
    talker.architectures = [ARCHITECTURE]
    rope = dict(talker.rope_parameters or {})
    setattr(talker, ROPE_KEY, dict(rope))
    rope.pop("mrope_section", None)
    rope.pop("mrope_interleaved", None)
    talker.rope_parameters = rope
    return talker


@dataclass
class StepTable:
    """One request's thinker part per talker position; positions past the end reuse the
    last row (text padding). The codec token's embedding is added from `codec_from` (the
    codec pad, then codec bos) on; not at the codec mask tokens, which only stand for
    positions."""

    rows: torch.Tensor
    codec_from: int
    # Multimodal RoPE positions: the thinker prompt's (3, P); every later index i is at
    # i + delta on all three axes.
    prompt_positions: torch.Tensor
    delta: int = 0

    def use_codec(self, positions: torch.Tensor) -> torch.Tensor:
        return positions >= self.codec_from

    def rope_positions(self, index: torch.Tensor) -> torch.Tensor:
        """(3, N) RoPE positions of the token indices `index`."""
        out = (index + self.delta).expand(3, -1).clone()
        inside = index < self.prompt_positions.shape[1]
        out[:, inside] = self.prompt_positions[:, index[inside]]
        return out


# token indices -> (thinker part, 1 where the token's embedding counts, RoPE positions)
StepInputs = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]


class Qwen2_5OmniTalkerForCodecGeneration(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        # The decoder runs the multimodal RoPE the checkpoint has (see talker_hf_config).
        decoder_config = copy.deepcopy(config)
        decoder_config.rope_parameters = getattr(config, ROPE_KEY, config.rope_parameters)
        self.mrope = "mrope_section" in decoder_config.rope_parameters
        self.model = Qwen2Model(
            vllm_config=vllm_config.with_hf_config(decoder_config), prefix=f"{prefix}model",
            decoder_layer_type=TalkerDecoderLayer,
        )
        # Codec embeddings live at the thinker's width, before the projection.
        self.model.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.embedding_size, prefix=f"{prefix}model.embed_tokens"
        )
        self.thinker_to_talker_proj = ReplicatedLinear(
            config.embedding_size, config.hidden_size, bias=True,
            prefix=f"{prefix}thinker_to_talker_proj",
        )
        self.codec_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}codec_head"
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        # Thinker embedding rows of the text tokens the talker's input uses.
        self.text_ids = self._text_token_ids(vllm_config.model_config.model)
        self.register_buffer(
            "text_embeds", torch.zeros(len(self.text_ids), config.embedding_size),
            persistent=False,
        )
        self.step_inputs: StepInputs | None = None  # set by the step-inputs worker

    def _text_token_ids(self, folder: str) -> dict[int, int]:
        """Thinker token id -> row in `text_embeds`: each speaker's text bos, eos, pad."""
        ids = [self.config.tts_text_end_token_id, self.config.tts_text_pad_token_id]
        if (Path(folder) / SPEAKERS_FILE).exists():
            ids += [int(s["bos_token"]) for s in speakers(folder).values()]
        ids.append(self.config.tts_text_start_token_id)
        return {tid: i for i, tid in enumerate(dict.fromkeys(ids))}

    def text_embedding(self, token_id: int) -> torch.Tensor:
        if token_id not in self.text_ids:
            raise ValueError(f"token {token_id} is not a talker text token of this model")
        return self.text_embeds[self.text_ids[token_id]]

    def step_table(
        self, tensors: dict[str, torch.Tensor], thinker_prompt: list[int], text_bos: int
    ) -> StepTable:
        """One request's table from the thinker's `hidden_states` and `embeds` (prompt rows,
        then one per reply token but the last): thinker prompt rows, the speaker's text bos,
        the reply rows, text eos, text pad. Multimodal placeholders contribute their hidden
        state only, not their (audio, image, video) embedding."""
        hidden, embeds = tensors["hidden_states"], tensors["embeds"].clone()
        prompt_len = len(thinker_prompt)
        media = torch.tensor([self.config.audio_token_index, self.config.image_token_index,
                              self.config.video_token_index])
        embeds[:prompt_len][torch.isin(torch.tensor(thinker_prompt), media)] = 0
        thinker = (hidden + embeds).to(self.text_embeds)
        if "positions" in tensors:
            positions, delta = tensors["positions"].long(), int(tensors["position_delta"])
        else:  # a thinker without multimodal RoPE: plain positions
            positions, delta = torch.arange(prompt_len).expand(3, -1), 0
        rows = torch.cat([
            thinker[:prompt_len],
            self.text_embedding(text_bos)[None],
            thinker[prompt_len:],
            self.text_embedding(self.config.tts_text_end_token_id)[None],
            self.text_embedding(self.config.tts_text_pad_token_id)[None],
        ])
        # The talker prompt is one codec mask per thinker prompt token, then codec pad and
        # codec bos.
        return StepTable(rows, prompt_len, positions.to(rows.device), delta)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor | IntermediateTensors:
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids)
        step = self.step_inputs(positions) if self.step_inputs is not None else None
        if step is not None:
            thinker_part, use_codec, rope_positions = step
            inputs_embeds = inputs_embeds * use_codec[:, None] + thinker_part
        if self.mrope:
            # Tokens without step inputs (warm-up runs) sit at their index on every axis.
            positions = positions.expand(3, -1) if step is None else rope_positions
        projected, _ = self.thinker_to_talker_proj(inputs_embeds)
        return self.model(None, positions, intermediate_tensors, projected)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.codec_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def talker_weights():
            for name, tensor in weights:
                if name == "thinker.model.embed_tokens.weight":
                    rows = torch.tensor(list(self.text_ids), dtype=torch.long)
                    self.text_embeds.copy_(tensor[rows].to(self.text_embeds.dtype))
                elif name.startswith("talker."):
                    yield name, tensor

        mapper = WeightsMapper(orig_to_new_prefix={"talker.": ""})
        return AutoWeightsLoader(self).load_weights(talker_weights(), mapper=mapper)
