"""Attention over a sequence split between ranks: Ulysses (all-to-all over heads) and ring
(key/value blocks passed around, partial results merged by their log-sum-exp), composed.

Each rank of a sequence-parallel group holds a contiguous slice of the text tokens and one of
the image tokens. Attention without a mask does not depend on the order of the keys, and
each query's output stays with its query, so the slices may be gathered in any order as
long as every token carries its own rotary position (applied before the exchange).

`FluxSequenceParallelProcessor` is an attention processor of our own for Flux's attention
modules, set with the public `set_attn_processor`: it projects, normalises and rotates as
Flux does, and replaces the one attention call by `SequenceParallelAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb

from vllm_omni.engine.diffusion.parallel.clock import COMM


@dataclass
class SequenceGroup:
    """This rank's places in its Ulysses and ring groups (global ranks, in group order)."""

    ulysses_ranks: list[int]
    ulysses_group: dist.ProcessGroup | None
    ring_ranks: list[int]
    ring_group: dist.ProcessGroup | None

    @property
    def ulysses_degree(self) -> int:
        return len(self.ulysses_ranks)

    @property
    def ring_degree(self) -> int:
        return len(self.ring_ranks)


class SequenceParallelAttention:
    """softmax(QK^T)V over the whole sequence from each rank's slice of it: q, k, v are
    [batch, local tokens, heads, head dim]; the result has q's shape."""

    def __init__(self, group: SequenceGroup) -> None:
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        u = self.group.ulysses_degree
        if u > 1:
            q, k, v = (self._heads_to_sequence(x) for x in (q, k, v))
        # [B, S, H, D] -> [B, H, S, D] for the attention kernels
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if self.group.ring_degree > 1:
            out = self._ring(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        out = out.transpose(1, 2)
        if u > 1:
            out = self._sequence_to_heads(out)
        return out

    # -- Ulysses ---------------------------------------------------------------------------

    def _heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S/u, H, D] on each rank -> [B, S, H/u, D]: rank j keeps head group j and
        receives every rank's tokens for it (in rank order)."""
        u = self.group.ulysses_degree
        b, s, h, d = x.shape
        send = x.reshape(b, s, u, h // u, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = torch.empty_like(send)
        with COMM.timing():
            dist.all_to_all_single(recv, send, group=self.group.ulysses_group)
        return recv.permute(1, 0, 2, 3, 4).reshape(b, u * s, h // u, d)

    def _sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse: [B, S, H/u, D] -> [B, S/u, H, D]."""
        u = self.group.ulysses_degree
        b, s, h, d = x.shape
        send = x.reshape(b, u, s // u, h, d).permute(1, 0, 2, 3, 4).contiguous()
        recv = torch.empty_like(send)
        with COMM.timing():
            dist.all_to_all_single(recv, send, group=self.group.ulysses_group)
        return recv.permute(1, 2, 0, 3, 4).reshape(b, s // u, u * h, d)

    # -- ring --------------------------------------------------------------------------------

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Each rank attends its queries to every rank's key/value block in turn; the next
        block travels (to the next rank, from the previous one) while this one computes."""
        ranks = self.group.ring_ranks
        me = ranks.index(dist.get_rank())
        send_to, recv_from = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
        kv = torch.stack([k, v]).contiguous()
        out = lse = None
        for turn in range(len(ranks)):
            pending = []
            if turn < len(ranks) - 1:
                incoming = torch.empty_like(kv)
                pending = [dist.isend(kv, send_to, group=self.group.ring_group),
                           dist.irecv(incoming, recv_from, group=self.group.ring_group)]
            block_out, block_lse = _attention_with_lse(q, kv[0], kv[1])
            if out is None:
                out, lse = block_out, block_lse
            else:
                merged = torch.logaddexp(lse, block_lse)
                out = out * torch.exp(lse - merged) + block_out * torch.exp(block_lse - merged)
                lse = merged
            with COMM.timing():
                for work in pending:
                    work.wait()
            if pending:
                kv = incoming
        return out.to(q.dtype)


def _attention_with_lse(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q to one key block, and the log-sum-exp of each query's scores (what
    merging it with other blocks needs); in fp32 whatever the inputs."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v.float(), lse


class FluxSequenceParallelProcessor:
    """Flux's joint (text + image) attention with the sequence split between ranks."""

    def __init__(self, group: SequenceGroup) -> None:
        self.attend = SequenceParallelAttention(group)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if attention_mask is not None:
            raise ValueError("sequence-parallel Flux attention takes no attention mask")

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, attn.head_dim))

        q = attn.norm_q(heads(attn.to_q(hidden_states)))
        k = attn.norm_k(heads(attn.to_k(hidden_states)))
        v = heads(attn.to_v(hidden_states))
        joint = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        if joint:  # double blocks: the text stream has projections of its own, text first
            q = torch.cat([attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states))), q], 1)
            k = torch.cat([attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states))), k], 1)
            v = torch.cat([heads(attn.add_v_proj(encoder_hidden_states)), v], 1)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out = self.attend(q, k, v).flatten(2, 3).to(q.dtype)
        if not joint:
            return out  # single blocks project after the attention themselves
        text = encoder_hidden_states.shape[1]
        text_out, image_out = out[:, :text], out[:, text:]
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())
