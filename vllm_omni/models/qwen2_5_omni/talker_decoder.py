"""The talker's decoder layer: a Qwen2 layer whose heads are `config.head_dim` wide.

The released talker's heads are not hidden_size / num_heads wide (896 wide, 12 heads of 128),
and vLLM's Qwen2 layer derives the head width from the hidden size. This layer is the same
computation (pre-norm attention with biased q, k, v and rotary positions, then the gated MLP)
with the width the checkpoint has; it plugs into vLLM's Qwen2Model as its
`decoder_layer_type`, so the weights load by Qwen2's names.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from vllm.config import CacheConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.models.qwen2 import Qwen2MLP


class TalkerAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, cache_config: CacheConfig | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.num_heads = heads // tp
        self.num_kv_heads = max(1, kv_heads // tp)  # fewer kv heads than ranks: replicated
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, heads, kv_heads, bias=True,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(
            heads * self.head_dim, config.hidden_size, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=config.rope_parameters)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5,
                              num_kv_heads=self.num_kv_heads, cache_config=cache_config,
                              quant_config=quant_config, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class TalkerDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, cache_config: CacheConfig | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = TalkerAttention(config, cache_config, quant_config,
                                         f"{prefix}.self_attn")
        self.mlp = Qwen2MLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's fused norm adds the residual and normalises in one call.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual
