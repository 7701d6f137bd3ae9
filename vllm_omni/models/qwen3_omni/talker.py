"""Qwen3-Omni's talker as a vLLM model: one whole codec frame (16 codes) per step.

The talker is an MoE decoder (vLLM's Qwen3-MoE, shared expert included) whose sampled token
is a frame's first code. Its input at a decode step is the frame it wrote the step before,
all 16 codes embedded and summed, plus the next reply token of the thinker (projected to the
talker's width). The other 15 codes come from the code predictor, a small dense decoder run
at the start of the next step from the talker's last state and the first code: transformers'
own module, run for every decoding request of the step at once, with a fresh cache per frame
as HF runs it. So a frame is whole one step after its first code is sampled. The codes go
out as the step's `omni_rows` ("codes", one row of 16 per token fed), which the hidden-states
worker keeps: the row of the token at prompt length + f holds frame f. The last sampled code
(codec eos, or the one the token limit stopped) is never fed, so its frame is never
completed, as in HF.

The prompt rows (the user turns and the assistant's start, see `step_table`) and the reply's
rows come per request through the step-inputs worker (vllm_omni.engine.ar.step_inputs).
Positions are plain indices on all three RoPE axes, which is what HF gives a talker prompt
without images or video (`talker_hf_config` turns the multimodal RoPE off).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper
from vllm.sequence import IntermediateTensors

ARCHITECTURE = "Qwen3OmniMoeTalkerForCodecGeneration"
ROW = "codes"
# Omni-config token ids the talker's inputs need, copied onto the talker config.
OMNI_IDS = ("im_start_token_id", "user_token_id", "assistant_token_id", "tts_pad_token_id",
            "tts_bos_token_id", "tts_eos_token_id")
# The code predictor samples (where the talker samples) as HF's generation config has it.
PREDICTOR_TOP_K, PREDICTOR_TOP_P = 50, 0.8


def talker_hf_config(config: PretrainedConfig) -> PretrainedConfig:
    """`hf_overrides` of the talker stage: the Omni config -> its talker config, with plain
    RoPE (see the module docstring) and the Omni token ids the talker reads."""
    talker = getattr(config, "talker_config", None)
    if talker is None:  # vLLM also calls this on a stand-in config to probe the model type
        return config
    talker.architectures = [ARCHITECTURE]
    for name in OMNI_IDS:
        setattr(talker, name, getattr(config, name))
    text = talker.text_config
    text.rope_parameters = {k: v for k, v in (text.rope_parameters or {}).items()
                            if k not in ("mrope_section", "mrope_interleaved", "interleaved")}
    return talker


def user_positions(ids: list[int], config: PretrainedConfig) -> list[int]:
    """Indices of the tokens of user turns (from their <|im_start|> on): the role of a token
    is the one after the last <|im_start|> at or before it, as HF reads it."""
    out, role = [], None
    for i, token in enumerate(ids):
        if token == config.im_start_token_id:
            role = ids[i + 1] if i + 1 < len(ids) else None
        if role == config.user_token_id:
            out.append(i)
    return out


def assistant_start(ids: list[int], config: PretrainedConfig) -> int:
    """Index of the last `<|im_start|>assistant` (the answer being spoken)."""
    for i in range(len(ids) - 2, -1, -1):
        if ids[i] == config.im_start_token_id and ids[i + 1] == config.assistant_token_id:
            return i
    raise ValueError("the thinker's prompt has no assistant turn to speak")


@dataclass
class FrameTable:
    """One request: its prompt rows, the reply rows fed one per frame, and what it wrote."""

    prompt_rows: torch.Tensor  # (P, H) the thinker's part of each prompt position
    codec_mask: torch.Tensor  # (P,) 1 where the prompt token's codec embedding counts
    trailing: torch.Tensor  # (R, H) reply rows, then tts_eos; tts_pad after them
    pad: torch.Tensor  # (H,)
    greedy: bool
    generator: torch.Generator
    frames: list[torch.Tensor] = field(default_factory=list)  # (16,) codes per frame
    last_hidden: torch.Tensor | None = None  # the state that sampled the newest code

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_rows)

    def text_row(self, frame: int) -> torch.Tensor:
        return self.trailing[frame] if frame < len(self.trailing) else self.pad


class Qwen3OmniMoeTalkerForCodecGeneration(nn.Module):
    omni_row_names = (ROW,)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration as CodePredictor,
        )
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerResizeMLP,
        )

        config = vllm_config.model_config.hf_config
        self.config = text = config.text_config
        self.talker_config = config
        self.model = Qwen3MoeModel(
            vllm_config=vllm_config.with_hf_config(text, architectures=["Qwen3MoeForCausalLM"]),
            prefix=f"{prefix}model")
        self.codec_head = ParallelLMHead(text.vocab_size, text.hidden_size,
                                         prefix=f"{prefix}codec_head")
        self.logits_processor = LogitsProcessor(text.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self.text_projection = Qwen3OmniMoeTalkerResizeMLP(config)
        self.hidden_projection = Qwen3OmniMoeTalkerResizeMLP(config)
        self.code_predictor = CodePredictor._from_config(config.code_predictor_config)
        # The thinker's embeddings of tts_bos, tts_eos and tts_pad.
        self.register_buffer("tts_embeds", torch.zeros(3, config.thinker_hidden_size),
                             persistent=False)
        self.groups = config.num_code_groups
        self.step_segments = None  # set by the step-inputs worker
        self.omni_rows: dict[str, torch.Tensor] = {}

    # -- per request -----------------------------------------------------------------------

    def step_table(self, tensors: dict[str, torch.Tensor], thinker_ids: list[int],
                   greedy: bool, seed: int) -> FrameTable:
        """The talker's prompt rows from the thinker's rows (one per thinker prompt token and
        reply token but the last): the user turns (text positions from their embedding,
        media positions from the accepted layer), then nine assistant positions: its
        `<|im_start|>assistant\\n`, four tts_pad, tts_bos and the first reply token (their codec
        part is the prompt's own tokens, see stages.thinker_to_talker). The later reply tokens
        and tts_eos are fed one per frame."""
        config = self.talker_config
        with torch.no_grad():
            dtype = self.tts_embeds.dtype
            embeds, accept = tensors["embeds"].to(dtype), tensors["accept_hidden"].to(dtype)
            ids = torch.tensor(thinker_ids)
            text = self.text_projection(embeds)
            user = torch.tensor(user_positions(thinker_ids, config), dtype=torch.long)
            media = torch.isin(ids[user], torch.tensor([
                config.audio_token_id, config.image_token_id, config.video_token_id]))
            user_rows = torch.where(media[:, None], self.hidden_projection(accept[user]),
                                    text[user])
            bos, eos, pad = self.text_projection(self.tts_embeds)
            answer = text[assistant_start(thinker_ids, config):]
            if len(answer) < 4:
                raise ValueError("the thinker's answer is empty: nothing to speak")
            assistant = torch.cat([answer[:3], pad.expand(4, -1), bos[None], answer[3:4]])
            prompt_rows = torch.cat([user_rows, assistant])
            codec_mask = torch.ones(len(prompt_rows))
            codec_mask[: len(user_rows) + 3] = 0
            generator = torch.Generator().manual_seed(seed)
            return FrameTable(prompt_rows, codec_mask, torch.cat([answer[4:], eos[None]]),
                              pad, greedy, generator)

    # -- the step --------------------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor | IntermediateTensors:
        segments = self.step_segments() if self.step_segments is not None else None
        embeds = self.model.embed_input_ids(input_ids)
        codes = torch.full((len(input_ids), self.groups), -1, dtype=torch.long,
                           device=input_ids.device)
        if segments:
            embeds = self._inputs(input_ids, positions, embeds, segments, codes)
        hidden = self.model(None, positions, intermediate_tensors, embeds)
        if segments:
            for table, start, n in segments:
                if table is not None:
                    table.last_hidden = hidden[start + n - 1].detach().clone()
        self.omni_rows = {ROW: codes}
        return hidden

    def _inputs(self, ids: torch.Tensor, positions: torch.Tensor, embeds: torch.Tensor,
                segments: list, codes: torch.Tensor) -> torch.Tensor:
        out = embeds.clone()
        new: list[tuple[int, FrameTable, int]] = []  # frames to complete in this step
        for table, start, n in segments:
            if table is None:
                continue
            pos = positions[start : start + n]
            prompt = pos < table.prompt_len  # the prompt's rows at once (a prefill's many)
            rows = start + torch.nonzero(prompt).flatten()
            out[rows] = (table.prompt_rows[pos[prompt]]
                         + embeds[rows] * table.codec_mask[pos[prompt], None])
            for k in torch.nonzero(~prompt).flatten().tolist():
                row, pos_k = start + k, int(pos[k])
                if pos_k - table.prompt_len < len(table.frames):  # computed again
                    frame = table.frames[pos_k - table.prompt_len]
                    out[row] = self._frame_embedding(frame[None])[0] + table.text_row(
                        pos_k - table.prompt_len)
                    codes[row] = frame
                else:
                    new.append((row, table, pos_k - table.prompt_len))
        if new:
            rows = [r for r, _, _ in new]
            frames = torch.cat([ids[rows][:, None], self._residual_codes(
                ids[rows], [t for _, t, _ in new])], dim=1)
            texts = torch.stack([t.text_row(f) for _, t, f in new])
            out[rows] = self._frame_embedding(frames) + texts
            codes[rows] = frames
            for (_, table, _), frame in zip(new, frames, strict=True):
                table.frames.append(frame)
        return out

    def _frame_embedding(self, frames: torch.Tensor) -> torch.Tensor:
        """(B, 16) codes -> the sum of their embeddings: the first code's from the talker,
        each residual one's from the code predictor's table for its group."""
        out = self.model.embed_input_ids(frames[:, 0])
        for i, table in enumerate(self.code_predictor.model.codec_embedding):
            out = out + table(frames[:, i + 1])
        return out

    @torch.no_grad()
    def _residual_codes(self, first: torch.Tensor, tables: list[FrameTable]) -> torch.Tensor:
        """Codes 1..15 of each frame: the code predictor from [the talker's last state, the
        first code's embedding], one group per pass, each request sampled as it asks."""
        from transformers import DynamicCache

        predictor = self.code_predictor
        start = torch.stack([torch.stack([t.last_hidden for t in tables]),
                             self.model.embed_input_ids(first)], dim=1)
        out = predictor(inputs_embeds=start, past_key_values=DynamicCache(
            config=predictor.config), use_cache=True)
        picked = [self._pick(out.logits[:, -1], tables)]
        for group in range(1, self.groups - 1):
            out = predictor(input_ids=picked[-1][:, None], past_key_values=out.past_key_values,
                            use_cache=True, generation_steps=group)
            picked.append(self._pick(out.logits[:, -1], tables))
        return torch.stack(picked, dim=1)

    @staticmethod
    def _pick(logits: torch.Tensor, tables: list[FrameTable]) -> torch.Tensor:
        out = logits.argmax(-1)
        for i, table in enumerate(tables):
            if table.greedy:
                continue
            row = logits[i].float()
            top = row.topk(min(PREDICTOR_TOP_K, len(row)))
            probs = top.values.softmax(-1)
            keep = probs.cumsum(-1) - probs < PREDICTOR_TOP_P
            probs = torch.where(keep, probs, 0)
            choice = torch.multinomial(probs / probs.sum(), 1, generator=table.generator)
            out[i] = top.indices[choice[0]]
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.codec_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        config = self.talker_config
        tts = torch.tensor([config.tts_bos_token_id, config.tts_eos_token_id,
                            config.tts_pad_token_id])

        def talker_weights():
            for name, tensor in weights:
                if name == "thinker.model.embed_tokens.weight":
                    self.tts_embeds.copy_(tensor[tts].to(self.tts_embeds.dtype))
                elif name == "talker.model.codec_embedding.weight":  # vLLM's name for it
                    yield "talker.model.embed_tokens.weight", tensor
                elif name.startswith("talker."):
                    yield name, tensor

        mapper = WeightsMapper(orig_to_new_prefix={"talker.": ""})
        return AutoWeightsLoader(self).load_weights(talker_weights(), mapper=mapper)
