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
from typing import Optional, Sequence

import torch

from shard.models.gpt import GPT, KVCache


def next_token(logits: torch.Tensor, temperature: float, top_k: Optional[int], generator) -> torch.Tensor:
    """One token id per row of `logits` (batch x vocabulary)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    # from the largest down before dividing: a tiny temperature then sends the others to
    # -inf (a draw of the most likely), not the largest to +inf (a softmax of NaNs)
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: GPT, prompt: Sequence[int], tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
             seed: int = 0, vocab: Optional[int] = None, stop: Optional[int] = None) -> list[int]:
    """The ids `model` continues `prompt` (a list of ids) with: `tokens` of them, fewer if it
    samples `stop`. Runs where the model's parameters are, in their dtype."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    outside = [t for t in prompt if not 0 <= t < model.cfg.vocab]
    if outside:   # (the embedding's IndexError would name no id)
        raise ValueError(f"prompt ids {outside[:4]} lie outside the model's vocabulary of {model.cfg.vocab} "
                         "(a tokenizer of another model?)")
    if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1):
        raise ValueError(f"tokens must be a positive integer, got {tokens!r}")
    if not (math.isfinite(temperature) and temperature >= 0) or (top_k is not None and top_k < 1):
        raise ValueError(f"temperature must be a finite number >= 0 and top_k >= 1, got {temperature} and {top_k}")
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
