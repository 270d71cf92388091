"""Sampling through the KV cache (shard/models/generate.py): greedy decoding against a full
forward per token and against transformers' generate, and what the sampling settings mean."""
import numpy as np
import pytest
import torch

from shard.models import GPT, GPTConfig
from shard.models.generate import generate, next_token
from shard.models.hf import from_pretrained
from tests.models.test_hf import random_hf_model

PROMPT = [5, 17, 3, 42, 8]


def transformers_greedy(model, prompt, tokens) -> list[int]:
    """The ids transformers' greedy decoding appends, with no end of text to stop at or to
    hold back (min_new_tokens would mask it)."""
    model.generation_config.eos_token_id = None
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False)
    return ids[0, len(prompt):].tolist()


def greedy_without_cache(model, prompt, tokens):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("preset", ["tiny", "llama_tiny"])
def test_greedy_through_the_cache_is_greedy_on_the_whole_sequence(preset):
    model = GPT(GPTConfig.preset(preset, vocab=96, context=64), seed=1)
    assert generate(model, PROMPT, 12, temperature=0) == greedy_without_cache(model, PROMPT, 12)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_is_transformers_greedy(kind, tmp_path):
    theirs = random_hf_model(kind)
    theirs.save_pretrained(tmp_path)
    assert generate(from_pretrained(tmp_path), PROMPT, 12, temperature=0) == transformers_greedy(theirs, PROMPT, 12)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_draws_follow_the_softmax_of_the_logits_over_the_temperature(temperature):
    """transformers' sampling: softmax(logits / T), and with top_k the k largest of it
    renormalised. 50,000 seeded draws: a standard error of at most 0.0023 per token."""
    logits = torch.tensor([2.0, 0.0, -1.0, -3.0]).expand(50_000, 4)
    generator = torch.Generator().manual_seed(0)
    for top_k in (None, 2):
        drawn = next_token(logits, temperature, top_k, generator)
        frequencies = torch.bincount(drawn, minlength=4) / drawn.numel()
        expected = (logits[0] / temperature).softmax(-1)
        if top_k:
            expected = torch.cat([expected[:top_k] / expected[:top_k].sum(), torch.zeros(4 - top_k)])
        torch.testing.assert_close(frequencies, expected, atol=0.01, rtol=0)


def test_sampling_settings():
    model = GPT(GPTConfig.preset("llama_tiny", vocab=96, context=64), seed=1)
    greedy = generate(model, PROMPT, 10, temperature=0)
    assert generate(model, PROMPT, 10, temperature=1.0, top_k=1, seed=3) == greedy   # top-1 is greedy
    a, b = (generate(model, PROMPT, 10, temperature=1.5, seed=s) for s in (7, 8))
    assert a == generate(model, PROMPT, 10, temperature=1.5, seed=7) and a != b   # seeded
    assert all(t < 20 for t in generate(model, PROMPT, 30, temperature=2.0, seed=1, vocab=20))
    assert generate(model, PROMPT, 10, temperature=0, stop=greedy[2]) == greedy[:3]   # ends at stop, kept
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [], 5)
    for bad in (96, -1):   # another tokenizer's ids: named, not the embedding's IndexError
        with pytest.raises(ValueError, match=rf"prompt ids \[{bad}\] lie outside the model's vocabulary of 96"):
            generate(model, [5, bad], 5)
    # the context holds the prompt and every token but the last, which is never fed back
    assert generate(model, PROMPT, 60, temperature=0) == greedy_without_cache(model, PROMPT, 60)
    with pytest.raises(ValueError, match="5 prompt tokens and 61 more need 65 positions, beyond the model's "
                                         "context of 64"):
        generate(model, PROMPT, 61)
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            generate(model, PROMPT, 5, temperature=bad)
    # a temperature far below the logits' spread is greedy, not a softmax of overflowed logits,
    # down to those fp32 holds as 0 (0 / 0 was NaN, and the draw raised)
    for tiny in (1e-40, 1e-46, 5e-324):
        assert generate(model, PROMPT, 10, temperature=tiny, seed=5) == greedy
    # a tokenizer's tensors and arrays are prompts too; a batch, floats and bad settings are named
    assert generate(model, torch.tensor(PROMPT), 10, temperature=0) == greedy
    assert generate(model, np.array([PROMPT]), 10, temperature=0) == greedy
    assert generate(model, PROMPT, np.int64(10), temperature=0) == greedy
    for bad, message in ((torch.tensor([PROMPT, PROMPT]), "one prompt at a time"),
                         ([1.5, 2.0], "must be a list of token ids")):
        with pytest.raises(ValueError, match=message):
            generate(model, bad, 5)
    for setting, message in (({"top_k": 2.5}, "top_k must be an integer"), ({"top_k": True}, "top_k must be an"),
                             ({"vocab": 0}, r"vocab must be in 1..96"), ({"vocab": 97}, r"vocab must be in 1..96"),
                             ({"seed": 2 ** 64}, "seed must be an integer in")):
        with pytest.raises(ValueError, match=message):
            generate(model, PROMPT, 5, **setting)
