"""Generic input processors: turn upstream stages' outputs into a stage's prompt.

An input processor is `f(upstream: dict[stage name, OmniRequestOutput], prompt) -> prompt`,
where `prompt` is the request's rendered entry prompt. Model families add their own.
"""

from __future__ import annotations

from typing import Any

from vllm_omni.outputs import OmniRequestOutput


def upstream_text(upstream: dict[str, OmniRequestOutput], prompt: Any) -> dict[str, str]:
    """The text of the (single) upstream stage, as a plain text prompt."""
    if len(upstream) != 1:
        raise ValueError(f"upstream_text takes one upstream stage, got {sorted(upstream)}")
    (out,) = upstream.values()
    return {"prompt": out.text or ""}


def joined_text(upstream: dict[str, OmniRequestOutput], prompt: Any) -> dict[str, str]:
    """Fan-in: the texts of every upstream stage, in the order of the stage's `inputs`,
    joined by a blank line."""
    return {"prompt": "\n\n".join(out.text or "" for out in upstream.values())}


def upstream_token_ids(upstream: dict[str, OmniRequestOutput], prompt: Any) -> dict[str, list]:
    """The token ids of the (single) upstream stage, as a token prompt."""
    if len(upstream) != 1:
        raise ValueError(f"upstream_token_ids takes one upstream stage, got {sorted(upstream)}")
    (out,) = upstream.values()
    return {"prompt_token_ids": out.token_ids or []}
