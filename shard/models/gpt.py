"""A decoder-only transformer of the GPT family: pre-norm blocks, causal self-attention
through torch's scaled_dot_product_attention, learned or rotary positions, optionally tied
embeddings. Its fields cover the published families:

    GPT-2, OPT      LayerNorm, GELU (or ReLU) MLP, learned positions, biases
    Llama, Mistral  RMSNorm, SwiGLU MLP, rotary positions (with Llama 3's scaling),
                    grouped-query attention (kv_heads), no biases; Qwen2: biases on q, k, v

Each block is a direct member of `blocks` (a ModuleList), so the engine's default units
are the embeddings, every block, and the final norm and head. Given the targets, the head
computes the loss itself, fused with the cross-entropy a chunk of tokens at a time
(shard/models/loss.py), so the logits of the whole batch are never written.

The projections are fused: `attn.qkv` holds the q, k and v rows (heads, then kv_heads,
then kv_heads heads), and a SwiGLU `mlp.up` the gate's rows, then the up projection's.
shard/models/hf.py maps them to and from Hugging Face's separate tensors.

Initialization is per parameter and seeded by the parameter's name (`init_parameter`), so
a model built on the meta device and materialized one unit at a time by the engine has
exactly the values an eagerly built model would have, on any number of ranks. A model
given `weights` (a `name, tensor -> None` filler: pretrained values) takes them instead.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shard.models.loss import linear_cross_entropy

POSITIONS = ("learned", "rotary")
NORMS = ("layer", "rms")
MLPS = ("gelu", "gelu_tanh", "relu", "swiglu")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary scaling (Meta's Llama 3.1 reference, `apply_scaling`): wavelengths
    longer than original_context / low_freq_factor are stretched by `factor`, shorter than
    original_context / high_freq_factor kept, and those between interpolated smoothly."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context: int

    def __post_init__(self) -> None:
        if not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor and self.original_context > 0):
            raise ValueError(f"rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                             f"original_context > 0, got {self}")

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        wavelength = 2 * math.pi / inv_freq
        low, high = self.original_context / self.low_freq_factor, self.original_context / self.high_freq_factor
        smooth = (self.original_context / wavelength - self.low_freq_factor) / (self.high_freq_factor
                                                                                - self.low_freq_factor)
        between = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        return torch.where(wavelength > low, inv_freq / self.factor, torch.where(wavelength < high, inv_freq, between))


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 4096
    context: int = 128
    width: int = 256
    layers: int = 4
    heads: int = 4
    tied: bool = True
    positions: str = "learned"
    bias: bool = False                         # on every projection and LayerNorm
    rope_theta: float = 10000.0
    kv_heads: Optional[int] = None             # grouped-query attention: k and v heads (None: heads)
    hidden: Optional[int] = None               # the MLP's inner width (None: 4 * width)
    mlp: str = "gelu"                          # gelu | gelu_tanh | relu | swiglu
    norm: str = "layer"                        # layer | rms
    norm_eps: float = 1e-5
    qkv_bias: Optional[bool] = None            # biases on q, k and v alone (None: as `bias`)
    rope_scaling: Optional[RopeScaling] = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):   # from a config file
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for name in ("vocab", "context", "width", "layers", "heads", "kv_heads", "hidden"):
            value = getattr(self, name)
            if name in ("kv_heads", "hidden") and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} must be divisible by heads {self.heads}")
        if self.heads % self.kv:
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv}")
        for name, options in (("positions", POSITIONS), ("norm", NORMS), ("mlp", MLPS)):
            if getattr(self, name) not in options:
                raise ValueError(f"{name} must be one of {options}, got {getattr(self, name)!r}")
        if self.positions == "rotary" and self.head_size % 2:
            raise ValueError(f"rotary positions need an even head size, got {self.head_size}")
        if self.rope_scaling is not None and self.positions != "rotary":
            raise ValueError("rope_scaling is for rotary positions; this model's are learned")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps!r}")

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; expected one of {tuple(PRESETS)}")
        return replace(PRESETS[name], **overrides)

    @property
    def head_size(self) -> int:
        return self.width // self.heads

    @property
    def kv(self) -> int:
        """Heads of k and v (kv_heads, or heads without grouped-query attention)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn(self) -> int:
        """The MLP's inner width."""
        return 4 * self.width if self.hidden is None else self.hidden

    @property
    def qkv_biased(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    def num_params(self) -> int:
        """Parameters (tied weights once), from the shapes alone."""
        d, f, qkv = self.width, self.ffn, (self.heads + 2 * self.kv) * self.head_size
        gates = 2 if self.mlp == "swiglu" else 1
        norm = d * (2 if self.norm == "layer" and self.bias else 1)
        attention = d * qkv + d * d + (qkv if self.qkv_biased else 0) + (d if self.bias else 0)
        mlp = (gates + 1) * d * f + ((gates * f + d) if self.bias else 0)
        embeddings = self.vocab * d * (1 if self.tied else 2)
        positions = self.context * d if self.positions == "learned" else 0
        return self.layers * (attention + mlp + 2 * norm) + embeddings + positions + norm

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training FLOPs per token: 6 per weight that multiplies (forward 2, backward 4),
        which excludes table lookups (positions, and the token embedding unless it is tied
        to the head), plus the attention scores and values, 12 * layers * width * seq_len
        (PaLM appendix B; nanoGPT and torchtitan count the same way, without halving for
        the causal mask; grouped k and v heads change neither product's size)."""
        t = self.context if seq_len is None else seq_len
        lookups = (self.context * self.width if self.positions == "learned" else 0)
        lookups += 0 if self.tied else self.vocab * self.width
        return 6 * (self.num_params() - lookups) + 12 * self.layers * self.width * t


# Table 1 of the PCCL paper takes its 7B and 13B shapes from OPT (Zhang et al., 2022); the
# smaller presets are OPT's too (vocabulary 50272, context 2048). The Llama presets are the
# published models' shapes (their Hugging Face config.json): Llama 3.2 1B, Llama 3 8B and
# Llama 2 13B.
_OPT = dict(vocab=50272, context=2048)
_LLAMA = dict(positions="rotary", norm="rms", mlp="swiglu", bias=False, tied=False)
_LLAMA3 = dict(_LLAMA, vocab=128256, rope_theta=500000.0, kv_heads=8)
PRESETS = {
    "tiny": GPTConfig(vocab=2048, context=256, width=128, layers=4, heads=4),
    "gpt_125m": GPTConfig(width=768, layers=12, heads=12, **_OPT),
    "gpt_350m": GPTConfig(width=1024, layers=24, heads=16, **_OPT),
    "gpt_1p3b": GPTConfig(width=2048, layers=24, heads=32, **_OPT),
    "gpt_2p7b": GPTConfig(width=2560, layers=32, heads=32, **_OPT),
    "gpt_7b": GPTConfig(width=4096, layers=32, heads=32, **_OPT),
    "gpt_13b": GPTConfig(width=5120, layers=40, heads=40, **_OPT),
    "gpt_66b": GPTConfig(width=9216, layers=64, heads=72, **_OPT),   # OPT-66B: the 70B class
    "llama_tiny": GPTConfig(vocab=2048, context=256, width=128, layers=4, heads=4, kv_heads=2, hidden=352, **_LLAMA),
    "llama_1b": GPTConfig(**{**_LLAMA3, "tied": True}, context=131072, width=2048, layers=16, heads=32, hidden=8192,
                          rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192)),
    "llama_8b": GPTConfig(**_LLAMA3, context=8192, width=4096, layers=32, heads=32, hidden=14336),
    "llama_13b": GPTConfig(**_LLAMA, vocab=32000, context=4096, width=5120, layers=40, heads=40, hidden=13824),
}
# Each preset's peak learning rate, the rate its size was trained with: GPT-3's (Brown et
# al., 2020, "Language Models are Few-Shot Learners", Table 2.1: 125M 6.0e-4, 350M 3.0e-4,
# 1.3B 2.0e-4, 2.7B 1.6e-4, 6.7B 1.2e-4, 13B 1.0e-4), which OPT keeps for these shapes,
# and OPT-66B's own (Zhang et al., 2022, Table 1); the Llamas' Llama 2's (Touvron et al.,
# 2023, Table 1: 3.0e-4 for 7B and 13B, kept for the smaller). tiny and llama_tiny: 1e-3, at
# which `make train`'s loss falls within its 200 steps. Larger models need smaller rates.
PEAK_LR = {"tiny": 1.0e-3, "gpt_125m": 6.0e-4, "gpt_350m": 3.0e-4, "gpt_1p3b": 2.0e-4, "gpt_2p7b": 1.6e-4,
           "gpt_7b": 1.2e-4, "gpt_13b": 1.0e-4, "gpt_66b": 0.8e-4,
           "llama_tiny": 1.0e-3, "llama_1b": 3.0e-4, "llama_8b": 3.0e-4, "llama_13b": 3.0e-4}


def peak_lr(preset: str) -> float:
    """The peak learning rate of a model preset (PEAK_LR)."""
    if preset not in PEAK_LR:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {tuple(PRESETS)}")
    return PEAK_LR[preset]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al., 2021) in the rotate-half form: each pair
    (x_i, x_{i+h/2}) of a head is turned by its position times that pair's frequency."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class Rotary:
    """cos and sin of positions 0, 1, ...: one float64 table per device, computed on first
    use (no buffers, so nothing to materialize from the meta device) and grown, at least
    doubling, when a call reaches past it; a call gets its rows in its dtype (rounded once
    from float64). One table serves every block, and GPT.forward makes it before the blocks
    run (ensure): a compiled block then only reads it, in its forward and in an activation
    checkpoint's recomputation alike (a table made inside the compiled forward traced
    another graph than the recomputation, which torch's checkpoint refuses). Sampling one
    position at a time keeps one table, as long as the context, not one per position."""

    def __init__(self, head_size: int, theta: float, scaling: Optional[RopeScaling] = None):
        # on the CPU even in a model built under torch.device("meta"): the tables need values
        inv_freq = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float64, device="cpu") / head_size)
        self.inv_freq = inv_freq if scaling is None else scaling.apply(inv_freq)
        self.tables: dict = {}

    def ensure(self, end: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The table of `device`, holding at least positions 0 .. end - 1."""
        key = str(device)
        table = self.tables.get(key)
        if table is None or len(table[0]) < end:
            rows = end if table is None else max(end, 2 * len(table[0]))
            angles = torch.outer(torch.arange(rows, dtype=torch.float64, device="cpu"), self.inv_freq)
            self.tables[key] = table = (angles.cos().to(device), angles.sin().to(device))
        return table

    def __call__(self, length: int, device, dtype, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.ensure(start + length, device)
        return cos[start:start + length].to(dtype), sin[start:start + length].to(dtype)


class KVCache:
    """Each block's keys and values of the positions seen so far, for sampling one token at
    a time (shard/models/generate.py): `length` positions of `capacity` are filled."""

    def __init__(self, cfg: GPTConfig, batch: int, capacity: int, device, dtype):
        shape = (batch, cfg.kv, capacity, cfg.head_size)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.layers)]
        self.capacity, self.length = capacity, 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of every position so far, with `k` and `v` (the new ones) stored."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; {self.length} are filled and "
                             f"{k.shape[2]} more were given")
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def rotary_of(cfg: GPTConfig) -> Optional[Rotary]:
    return Rotary(cfg.head_size, cfg.rope_theta, cfg.rope_scaling) if cfg.positions == "rotary" else None


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, rotary: Optional[Rotary] = None):
        """`rotary`: the model's table, shared by its blocks (default: one of its own)."""
        super().__init__()
        self.heads, self.kv, self.head_size = cfg.heads, cfg.kv, cfg.head_size
        self.qkv = nn.Linear(cfg.width, (cfg.heads + 2 * cfg.kv) * cfg.head_size, bias=cfg.qkv_biased)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=cfg.bias)
        self.rotary = rotary or rotary_of(cfg)

    def forward(self, x: torch.Tensor, cache: Optional[KVCache] = None, layer: int = 0) -> torch.Tensor:
        b, t, c = x.shape
        start = 0 if cache is None else cache.length
        q, k, v = self.qkv(x).split([self.heads * self.head_size, self.kv * self.head_size,
                                     self.kv * self.head_size], dim=-1)
        q = q.view(b, t, self.heads, self.head_size).transpose(1, 2)
        k = k.view(b, t, self.kv, self.head_size).transpose(1, 2)
        v = v.view(b, t, self.kv, self.head_size).transpose(1, 2)
        if self.rotary is not None:
            cos, sin = self.rotary(t, x.device, q.dtype, start)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.extend(layer, k, v)
        # with a cache, the new positions see all earlier ones: causal within the new ones alone
        # (one new position sees every key: no mask. SDPA's is_causal aligns its mask to the
        # top left, so it holds only where no earlier position is cached)
        causal = start == 0
        mask = None if causal or t == 1 else torch.ones(t, start + t, dtype=torch.bool, device=x.device).tril(start)
        # grouped-query attention: each k and v head serves heads / kv query heads
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           enable_gqa=self.kv != self.heads)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "swiglu": F.silu}


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gated, self.activation = cfg.mlp == "swiglu", ACTIVATIONS[cfg.mlp]
        self.up = nn.Linear(cfg.width, (2 if self.gated else 1) * cfg.ffn, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn, cfg.width, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.gated:   # SwiGLU (Shazeer, 2020): silu(x W_gate) * (x W_up)
            gate, h = h.chunk(2, dim=-1)
            return self.down(self.activation(gate) * h)
        return self.down(self.activation(h))


def norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rms":
        return nn.RMSNorm(cfg.width, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.width, eps=cfg.norm_eps, bias=cfg.bias)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, rotary: Optional[Rotary] = None):
        super().__init__()
        self.ln1, self.attn = norm(cfg), SelfAttention(cfg, rotary)
        self.ln2, self.mlp = norm(cfg), MLP(cfg)

    def forward(self, x: torch.Tensor, cache: Optional[KVCache] = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache, layer)
        return x + self.mlp(self.ln2(x))


class Head(nn.Linear):
    """The output head: the logits, or given the targets, the mean cross-entropy over
    them without the logits (linear_cross_entropy)."""

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, targets)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0, weights: Optional[Callable[[str, torch.Tensor], None]] = None):
        super().__init__()
        self.cfg, self.seed, self.weights = cfg, seed, weights
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.context, cfg.width) if cfg.positions == "learned" else None
        self.rotary = rotary_of(cfg)   # one table for every block
        self.blocks = nn.ModuleList(Block(cfg, self.rotary) for _ in range(cfg.layers))
        self.norm = norm(cfg)
        self.head = Head(cfg.width, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.embed.weight
        if self.embed.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for name, p in self.named_parameters():
                self.init_parameter(name, p)

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Fill one parameter in place: from `weights` where the model has them, else from a
        generator seeded by (seed, name): GPT-2's scheme, normal(0, 0.02) weights, residual
        projections scaled by 1/sqrt(2 * layers), zero biases, unit norm gains."""
        if self.weights is not None:
            self.weights(name, tensor)
        elif name.endswith("bias"):
            tensor.zero_()
        elif tensor.dim() == 1:
            tensor.fill_(1.0)
        else:
            residual = name.endswith(("attn.proj.weight", "mlp.down.weight"))
            std = 0.02 / math.sqrt(2 * self.cfg.layers) if residual else 0.02
            generator = torch.Generator(tensor.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            tensor.normal_(0.0, std, generator=generator)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        """The logits of each position, or given `targets` (one per position), the mean
        cross-entropy of predicting them. With a `cache`, `tokens` follow the positions it
        holds, and their keys and values join it."""
        start = 0 if cache is None else cache.length
        if start + tokens.shape[1] > self.cfg.context:
            raise ValueError(f"sequence of {start + tokens.shape[1]} tokens exceeds the context of {self.cfg.context}")
        x = self.embed(tokens)
        if self.rotary is not None:   # made here, outside any compiled block (Rotary)
            self.rotary.ensure(start + tokens.shape[1], tokens.device)
        if self.pos is not None:
            x = x + self.pos(torch.arange(start, start + tokens.shape[1], device=tokens.device))
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer)
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.head(self.norm(x), targets)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
