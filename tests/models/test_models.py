"""GPT presets, parameter counts, FLOPs per token, rotary positions, seeded initialization."""
import math

import pytest
import torch
from torch import nn

from shard.models import GPT, PRESETS, GPTConfig
from shard.models.gpt import Rotary, rotate

SMALL = dict(vocab=96, context=32, width=32, layers=2, heads=4)


@pytest.mark.parametrize("kwargs", [{}, dict(tied=False), dict(bias=True), dict(positions="rotary"),
                                    dict(bias=True, tied=False, positions="rotary")])
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


@pytest.mark.parametrize("kwargs", [{}, dict(tied=False), dict(positions="rotary")])
def test_flops_per_token_is_six_per_multiplying_weight_plus_attention(kwargs):
    cfg = GPTConfig(**SMALL, **kwargs)
    model = GPT(cfg)
    matmul_weights = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
                         for m in model.modules() if isinstance(m, nn.Linear))
    norms = sum(p.numel() for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters())
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
