"""A byte-level BPE tokenizer trained locally, so tiny models need no download."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TEXT_PART = "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"


def chatml_template(part: str = TEXT_PART) -> str:
    """ChatML, the format of Qwen2 chat models (the same shape of prompt a real model gets);
    `part` renders one item of a message's content list."""
    return (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}" + part + "{% endfor %}{% endif %}"
        "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


CHATML_TEMPLATE = chatml_template()

_WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said each she which do their time if will way about many then them write would "
    "like so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find "
    "image audio video speech model stage pipeline token serve request stream picture voice "
    "hello world tell me story about cat dog red blue green quick brown fox jumps lazy"
).split()


def _corpus(seed: int, n_lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = rng.choices(_WORDS, k=rng.randint(3, 14))
        line = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        if rng.random() < 0.2:
            line += f" {rng.randint(0, 9999)}"
        lines.append(line)
    return lines


def train_tokenizer(
    vocab_size: int, special_tokens: list[str], seed: int = 0
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on a seeded synthetic corpus (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)
