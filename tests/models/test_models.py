"""The decoder's presets (GPT and Llama), parameter counts, FLOPs per token, rotary positions,
grouped-query attention, the KV cache, seeded initialization."""
import math

import pytest
import torch
from torch import nn

from shard.models import GPT, PRESETS, GPTConfig
from shard.models.gpt import KVCache, RopeScaling, Rotary, rotate

SMALL = dict(vocab=96, context=32, width=32, layers=2, heads=4)
LLAMA = dict(positions="rotary", norm="rms", mlp="swiglu", kv_heads=2, hidden=48, tied=False)


@pytest.mark.parametrize("kwargs", [{}, dict(tied=False), dict(bias=True), dict(positions="rotary"),
                                    dict(bias=True, tied=False, positions="rotary"), LLAMA,
                                    dict(LLAMA, qkv_bias=True), dict(LLAMA, bias=True), dict(mlp="relu", hidden=40)])
def test_parameter_count_formula_matches_the_module(kwargs):
    cfg = GPTConfig(**SMALL, **kwargs)
    assert cfg.num_params() == GPT(cfg).num_params()


def test_presets_have_the_papers_shapes_and_sizes():
    # PCCL paper Table 1 (shapes from OPT): 7B is 32 x 4096 x 32 heads, 13B is 40 x 5120 x 40.
    assert (PRESETS["gpt_7b"].layers, PRESETS["gpt_7b"].width, PRESETS["gpt_7b"].heads) == (32, 4096, 32)
    assert (PRESETS["gpt_13b"].layers, PRESETS["gpt_13b"].width, PRESETS["gpt_13b"].heads) == (40, 5120, 40)
    # Sizes as the names say, within the rounding of the names (OPT: 125M ... 13B).
    for name, billions in [("gpt_125m", 0.125), ("gpt_350m", 0.35), ("gpt_1p3b", 1.3), ("gpt_2p7b", 2.7),
                           ("gpt_7b", 6.7), ("gpt_13b", 13.0), ("gpt_66b", 66.0)]:
        n = PRESETS[name].num_params() / 1e9
        assert abs(n - billions) / billions < 0.03, (name, n)
    with torch.device("meta"):   # the formula holds for the big ones too, without allocating them
        assert GPT(PRESETS["gpt_13b"]).num_params() == PRESETS["gpt_13b"].num_params()


def test_llama_presets_have_the_published_sizes():
    # the parameter counts Meta and Hugging Face publish for these models
    published = {"llama_1b": 1_235_814_400, "llama_8b": 8_030_261_248, "llama_13b": 13_015_864_320}
    for name, count in published.items():
        assert PRESETS[name].num_params() == count, name
        with torch.device("meta"):
            assert GPT(PRESETS[name]).num_params() == count, name
    c = PRESETS["llama_8b"]   # Llama 3 8B: 32 layers of 4096, 32 heads of which 8 carry k and v
    assert (c.layers, c.width, c.heads, c.kv, c.ffn, c.vocab) == (32, 4096, 32, 8, 14336, 128256)


@pytest.mark.parametrize("kwargs", [{}, dict(tied=False), dict(positions="rotary"), LLAMA])
def test_flops_per_token_is_six_per_multiplying_weight_plus_attention(kwargs):
    cfg = GPTConfig(**SMALL, **kwargs)
    model = GPT(cfg)
    matmul_weights = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
                         for m in model.modules() if isinstance(m, nn.Linear))
    norms = sum(p.numel() for m in model.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm))
                for p in m.parameters())
    seq = 24
    assert cfg.flops_per_token(seq) == 6 * (matmul_weights + norms) + 12 * cfg.layers * cfg.width * seq
    # and the 7B figure at 2048 tokens against the closed form 6N + 12 L d T
    c = PRESETS["gpt_7b"]
    n = c.num_params() - c.context * c.width
    assert c.flops_per_token(2048) == 6 * n + 12 * 32 * 4096 * 2048


def test_rotary_scores_depend_only_on_relative_position():
    head = 8
    rotary = Rotary(head, 10000.0)
    cos, sin = rotary(16, "cpu", torch.float64)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(head, dtype=torch.float64, generator=g), torch.randn(head, dtype=torch.float64, generator=g)
    def score(i, j):
        return torch.dot(rotate(q, cos[i], sin[i]), rotate(k, cos[j], sin[j])).item()
    assert score(5, 2) == pytest.approx(score(12, 9), rel=1e-12)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)
    # a rotation keeps the norm, and position 0 is the identity
    assert rotate(q, cos[7], sin[7]).norm().item() == pytest.approx(q.norm().item(), rel=1e-12)
    assert torch.equal(rotate(q, cos[0], sin[0]), q)


def test_rotary_model_is_causal():
    model = GPT(GPTConfig(**SMALL, positions="rotary"))
    x = torch.randint(0, 96, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 96
    a, b = model(x), model(y)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6) and not torch.allclose(a[:, 10:], b[:, 10:])


def test_initialization_is_seeded_per_parameter():
    cfg = GPTConfig(**SMALL)
    a, b, c = GPT(cfg, seed=1), GPT(cfg, seed=1), GPT(cfg, seed=2)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
        if p.dim() >= 2:
            assert not torch.equal(p, r), name
    # one parameter alone, into any tensor, gives the value the model has
    w = torch.empty(cfg.width * 3, cfg.width)
    a.init_parameter("blocks.1.attn.qkv.weight", w)
    assert torch.equal(w, a.blocks[1].attn.qkv.weight)
    # GPT-2 scheme: residual projections are scaled down by sqrt(2 * layers)
    assert a.blocks[0].attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.15)
    assert a.blocks[0].mlp.up.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(a.blocks[0].ln1.weight, torch.ones(cfg.width))
    assert a.head.weight is a.embed.weight


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(width=30, heads=4)
    with pytest.raises(ValueError, match="positions"):
        GPTConfig(positions="alibi")
    with pytest.raises(ValueError, match="even head size"):
        GPTConfig(width=12, heads=4, positions="rotary")
    with pytest.raises(ValueError, match="unknown model preset"):
        GPTConfig.preset("gpt_1t")
    with pytest.raises(ValueError, match="layers"):
        GPTConfig(layers=0)
    with pytest.raises(ValueError, match="exceeds the context"):
        GPT(GPTConfig(**SMALL))(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="heads 4 must be a multiple of kv_heads 3"):
        GPTConfig(**{**SMALL, "kv_heads": 3})
    with pytest.raises(ValueError, match="mlp must be one of"):
        GPTConfig(mlp="geglu")
    with pytest.raises(ValueError, match="norm must be one of"):
        GPTConfig(norm="batch")
    with pytest.raises(ValueError, match="rope_scaling is for rotary positions"):
        GPTConfig(rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=64))


def test_rotary_rows_for_positions_one_at_a_time_are_the_whole_tables_rows_in_one_table():
    """Sampling asks for one position at a time; each used to get a table of its own."""
    whole_cos, whole_sin = Rotary(8, 10000.0)(40, "cpu", torch.float32)
    rotary = Rotary(8, 10000.0)
    rows = [rotary(5, "cpu", torch.float32)] + [rotary(1, "cpu", torch.float32, start) for start in range(5, 40)]
    assert torch.equal(torch.cat([c for c, _ in rows]), whole_cos) and torch.equal(torch.cat([s for _, s in rows]),
                                                                                    whole_sin)
    (cos, _), = rotary.tables.values()   # one table, grown by doubling: 5, 10, 20, 40 rows
    assert len(cos) == 40
    assert set(rotary.tables) == {"cpu"}
    rotary(3, "cpu", torch.float64)
    assert len(rotary.tables) == 1   # a table per device, rows in each call's dtype
    model = GPT(GPTConfig(**SMALL, **LLAMA))
    assert all(block.attn.rotary is model.rotary for block in model.blocks), "one table for every block"


def test_a_kv_cache_refuses_positions_past_its_capacity():
    cfg = GPTConfig(**SMALL, **LLAMA)
    model, cache = GPT(cfg), KVCache(cfg, 1, 4, "cpu", torch.float32)
    model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="the KV cache holds 4 positions; 3 are filled and 2 more were given"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)


def test_grouped_query_attention_is_attention_with_each_kv_head_repeated():
    """The reference: k and v heads copied out to one per query head, as before GQA kernels."""
    cfg = GPTConfig(**SMALL, **LLAMA)
    attn = GPT(cfg).blocks[0].attn
    x = torch.randn(2, 10, cfg.width)
    q, k, v = attn.qkv(x).split([cfg.width, cfg.kv * cfg.head_size, cfg.kv * cfg.head_size], dim=-1)
    q, k, v = (z.view(2, 10, -1, cfg.head_size).transpose(1, 2) for z in (q, k, v))
    cos, sin = attn.rotary(10, "cpu", torch.float32)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k, v = (z.repeat_interleave(cfg.heads // cfg.kv, dim=1) for z in (k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(cfg.head_size)
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 10, cfg.width)
    torch.testing.assert_close(attn(x), attn.proj(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs", [{}, LLAMA])
def test_sampling_through_the_kv_cache_gives_the_full_forwards_logits(kwargs):
    cfg = GPTConfig(**SMALL, **kwargs)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab, (2, 20))
    cache = KVCache(cfg, batch=2, capacity=cfg.context, device="cpu", dtype=torch.float32)
    steps = [model(x[:, :12], cache=cache)] + [model(x[:, i:i + 1], cache=cache) for i in range(12, 16)]
    steps.append(model(x[:, 16:20], cache=cache))   # several tokens after cached ones: the mask's own path
    torch.testing.assert_close(torch.cat(steps, dim=1), model(x), rtol=1e-5, atol=1e-5)
    assert cache.length == 20
    with pytest.raises(ValueError, match="sequence of 33 tokens exceeds the context of 32"):
        model(torch.zeros(2, 13, dtype=torch.long), cache=cache)


def test_llama3_rope_scaling_keeps_short_wavelengths_and_stretches_long_ones():
    """Meta's Llama 3.1 rule, checked at its three regimes by hand."""
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=64)
    # wavelengths 6.3 and 16 (< 64/4: kept), 32 (between: smoothed), 1000 (> 64: divided by 8)
    inv_freq = torch.tensor([1.0, 2 * math.pi / 16, 2 * math.pi / 32, 2 * math.pi / 1000], dtype=torch.float64)
    out = scaling.apply(inv_freq)
    assert out[0] == inv_freq[0] and out[1] == inv_freq[1]
    smooth = (64 / 32 - 1.0) / (4.0 - 1.0)
    assert out[2].item() == pytest.approx((1 - smooth) * inv_freq[2].item() / 8 + smooth * inv_freq[2].item())
    assert out[3].item() == pytest.approx(inv_freq[3].item() / 8)
