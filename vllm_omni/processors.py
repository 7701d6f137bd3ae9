"""Generic input processors: turn upstream stages' outputs into a stage's prompt.

An input processor is `f(upstream: dict[stage name, OmniRequestOutput], prompt) -> prompt`,
where `prompt` is the request's rendered entry prompt. Model families add their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_omni.outputs import OmniRequestOutput

# A request whose answer is already written (text to speech): the text stage's prompt ends
# with the answer, and its SamplingParams' extra_args[REPLY_START] is where the answer starts.
# Processors of stages that speak (or otherwise use) the answer treat prompt rows from there
# on as the answer's, as if the text stage had generated them.
REPLY_START = "omni_reply_start"


@dataclass
class PromptGroup:
    """Several prompts that one request runs through one stage, each as its own engine
    request, so the engine batches them (a prompt and its negative prompt through a text
    encoder, say). The stage's output that its consumers see is the first prompt's, with
    every prompt's finished output, in order, in its `parts`."""

    prompts: list[Any]


def reply_start(text_params: Any, prompt_len: int) -> int:
    """Where the answer starts in the text stage's prompt (its end, for a normal request)."""
    start = ((getattr(text_params, "extra_args", None) or {}).get(REPLY_START))
    if start is None:
        return prompt_len
    if not 0 < start <= prompt_len:
        raise ValueError(f"{REPLY_START} {start} is outside the prompt (length {prompt_len})")
    return start


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
