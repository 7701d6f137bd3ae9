"""Qwen3-Omni's thinker as vLLM runs it, plus the hidden layer its talker reads.

The talker reads the thinker's input embeddings and the output of one intermediate decoder
layer (`talker_config.accept_hidden_layer`, HF's `hidden_states[accept_hidden_layer]`), not the
final norm's output. vLLM's thinker can return the outputs of chosen layers beside its final
states (the auxiliary hidden states of its EAGLE-3 interface), from inside the compiled
decoder; this subclass asks for that layer and hands it on as `omni_rows`, the extra per-token
rows the hidden-states worker (vllm_omni.engine.ar.hidden_states) keeps beside the embeddings
and the final states. Its forward returns what vLLM's does, so sampling is unchanged.

Selected by the stage's `hf_overrides` (`architectures`), registered by vllm_omni.plugin.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3_omni_moe_thinker import (
    Qwen3OmniMoeThinkerForConditionalGeneration,
)
from vllm.sequence import IntermediateTensors

ARCHITECTURE = "Qwen3OmniMoeThinkerWithTalkerRows"
ROW = "accept_hidden"


class Qwen3OmniMoeThinkerWithTalkerRows(Qwen3OmniMoeThinkerForConditionalGeneration):
    omni_row_names = (ROW,)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        talker = getattr(vllm_config.model_config.hf_config, "talker_config", None)
        if talker is None:
            raise ValueError("this Qwen3-Omni folder has no talker config to read the talker's "
                             "layer from (accept_hidden_layer)")
        # vLLM's layer k is the input of decoder layer k: HF's hidden_states[k].
        self.set_aux_hidden_state_layers((talker.accept_hidden_layer,))
        self.omni_rows: dict[str, torch.Tensor] = {}

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor | IntermediateTensors:
        out = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        if isinstance(out, tuple):
            out, (layer,) = out
            self.omni_rows = {ROW: layer}
        return out
