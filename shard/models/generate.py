"""Sampling text from a model, one token at a time through a KV cache: the prompt's keys and
values are computed once, and each new token costs one position's forward.

    ids = generate(model, prompt_ids, tokens=50, temperature=0.8, top_k=40, seed=0)

temperature 0 is greedy (the most likely token each step, as transformers' do_sample=False).
Above it, the logits are divided by the temperature and, with top_k, all but the k largest
dropped, then a token is drawn from their softmax by a seeded generator. `vocab` limits the
choice to the tokenizer's ids where the model's embedding is larger (a corpus's tokenizer
may have fewer pieces than the model has rows), and `stop` ends the text at a token (EOS).
"""
from __future__ import annotations

import math
import operator
from typing import Optional, Sequence

import torch

from shard.models.gpt import GPT, KVCache


def next_token(logits: torch.Tensor, temperature: float, top_k: Optional[int], generator) -> torch.Tensor:
    """One token id per row of `logits` (batch x vocabulary)."""
    if temperature < torch.finfo(torch.float32).tiny:   # 0, or one fp32 holds as 0 (0 / 0 would be NaN)
        return logits.argmax(dim=-1)
    # from the largest down before dividing: a tiny temperature then sends the others to
    # -inf (a draw of the most likely), not the largest to +inf (a softmax of NaNs)
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def check_seed(seed: Optional[int]) -> None:
    """ValueError unless `seed` is one torch.Generator takes (an int64 or uint64 value)."""
    if seed is None or not -2 ** 63 <= seed < 2 ** 64:
        raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {seed!r}")


@torch.no_grad()
def generate(model: GPT, prompt: Sequence[int], tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
             seed: int = 0, vocab: Optional[int] = None, stop: Optional[int] = None) -> list[int]:
    """The ids `model` continues `prompt` (a list of ids) with: `tokens` of them, fewer if it
    samples `stop`. Runs where the model's parameters are, in their dtype."""
    if isinstance(prompt, torch.Tensor) or hasattr(prompt, "tolist"):   # a tokenizer's tensor or array
        if getattr(prompt, "ndim", 1) > 1 and any(n != 1 for n in prompt.shape[:-1]):
            raise ValueError(f"one prompt at a time: got ids of shape {tuple(prompt.shape)}")
        prompt = [int(t) for t in prompt.reshape(-1).tolist()]
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ValueError(f"the prompt must be a list of token ids (ints), got {list(prompt)[:4]}")
    outside = [t for t in prompt if not 0 <= t < model.cfg.vocab]
    if outside:   # (the embedding's IndexError would name no id)
        raise ValueError(f"prompt ids {outside[:4]} lie outside the model's vocabulary of {model.cfg.vocab} "
                         "(a tokenizer of another model?)")
    tokens, top_k, vocab, seed = (_integer(name, v) for name, v in
                                  (("tokens", tokens), ("top_k", top_k), ("vocab", vocab), ("seed", seed)))
    if tokens is None or tokens < 1:
        raise ValueError(f"tokens must be a positive integer, got {tokens!r}")
    if not (math.isfinite(temperature) and temperature >= 0) or (top_k is not None and top_k < 1):
        raise ValueError(f"temperature must be a finite number >= 0 and top_k >= 1, got {temperature} and {top_k}")
    if vocab is not None and not 1 <= vocab <= model.cfg.vocab:
        raise ValueError(f"vocab must be in 1..{model.cfg.vocab} (the model's vocabulary), got {vocab}")
    check_seed(seed)
    positions = len(prompt) + tokens - 1   # the last token sampled is never fed back
    if positions > model.cfg.context:
        raise ValueError(f"{len(prompt)} prompt tokens and {tokens} more need {positions} positions, beyond the "
                         f"model's context of {model.cfg.context}")
    weight = model.embed.weight
    model.eval()
    cache = KVCache(model.cfg, 1, positions, weight.device, weight.dtype)
    generator = torch.Generator(weight.device).manual_seed(seed)
    logits = model(torch.tensor([list(prompt)], device=weight.device), cache=cache)[:, -1]
    out: list[int] = []
    while True:
        if vocab is not None:
            logits = logits[:, :vocab]
        token = next_token(logits, temperature, top_k, generator)
        out.append(int(token.item()))
        if len(out) == tokens or out[-1] == stop:
            return out
        logits = model(token.view(1, 1), cache=cache)[:, -1]


def _integer(name: str, value):
    """`value` as an int (numpy's integers too), None as None; ValueError naming `name`."""
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
