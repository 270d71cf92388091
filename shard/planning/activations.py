"""Activation memory of the decoder (shard/models/gpt.py, GPT and Llama alike) in training:
the bytes autograd keeps from the forward pass for the backward, at the end of the forward,
per micro-batch of b sequences of t tokens, with and without activation checkpointing.

Per token, e bytes per element of the compute dtype, width d, heads a, q, k and v's width
Q = (a + 2 kv_heads) d / a, the MLP's inner width f, vocabulary V:

    a block                   (3 d + Q + M) e + 2 N + 4 a
        qkv's input d, q, k and v (one tensor, Q), attention's output d (proj's input: a
        view of it), up's input d; the MLP's M: GELU's input f and down's input f (2 f),
        ReLU's output, which is down's input (f), SwiGLU's gate and up (one tensor, 2 f),
        silu's output f and down's input f (4 f); each norm's N; attention's log-sum-exp
        per head in fp32 (torch's CPU flash-attention kernel: no t x t scores, and grouped
        k and v heads are not copied out)
        rotary positions: + (2 d + kv_heads d / a) e (the rotated q and k, and proj's
        input, now a copy)
    a norm's N                LayerNorm (d + 2) e: its input, mean and 1/std;
                              RMSNorm (2 d + 1) 4: torch computes it in fp32 (its input,
                              1/rms and the normalized input, all fp32, in any dtype)
    a checkpointed block      d e     (its input; one block is recomputed at a time)
    the head                  N + d e, and V d e once
        the final norm's; the loss, fused with the head (shard/models/loss.py), keeps its
        input's gradient and its weight's (in the weight's dtype: the compute dtype under
        the engine), and no logits
    the embeddings            8       (the int64 token id)

and per sequence position: the int64 position index (learned positions, once), or the
rotary cos and sin tables (d / a values in all, in every block: each attention keeps its
own; none kept with checkpointing, where the blocks recompute them). Everything is exact for the model on
CPU; tests/shard/test_activations.py holds it against autograd's saved tensors. On GPUs
the attention kernel keeps its own (flash or memory-efficient: the same d of output, a
log-sum-exp, a few bytes of RNG state), and the other terms are the same.
"""
from __future__ import annotations

from shard.models.gpt import GPTConfig

INT64 = 8
FP32 = 4
MLP_KEEPS = {"gelu": 2, "gelu_tanh": 2, "relu": 1, "swiglu": 4}   # M / f


def norm_bytes(cfg: GPTConfig, element: int) -> int:
    """What one norm keeps per token (N)."""
    return (2 * cfg.width + 1) * FP32 if cfg.norm == "rms" else (cfg.width + 2) * element


def block_bytes(cfg: GPTConfig, tokens: int, element: int, checkpointed: bool = False) -> int:
    """What one block keeps for `tokens` tokens of `element`-byte values."""
    d = cfg.width
    if checkpointed:
        return tokens * d * element
    qkv = (cfg.heads + 2 * cfg.kv) * cfg.head_size
    rotary = 2 * d + cfg.kv * cfg.head_size if cfg.positions == "rotary" else 0
    kept = 3 * d + qkv + MLP_KEEPS[cfg.mlp] * cfg.ffn + rotary
    return tokens * (kept * element + 2 * norm_bytes(cfg, element) + FP32 * cfg.heads)


def head_bytes(cfg: GPTConfig, tokens: int, element: int) -> int:
    """What the final norm, the head and the loss keep for `tokens` tokens."""
    return tokens * (norm_bytes(cfg, element) + cfg.width * element) + cfg.vocab * cfg.width * element


def activation_bytes(cfg: GPTConfig, micro_batch: int, seq_len: int, element: int,
                     checkpointing: bool = False) -> int:
    """What the whole model keeps at the end of the forward pass of one micro-batch of
    `micro_batch` sequences of `seq_len` tokens in a compute dtype of `element` bytes
    (the loss fused with the head, as the model computes it given the targets)."""
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("element", element)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if seq_len > cfg.context:
        raise ValueError(f"seq_len {seq_len} exceeds the model's context {cfg.context}")
    tokens = micro_batch * seq_len
    blocks = cfg.layers * block_bytes(cfg, tokens, element, checkpointing)
    head = head_bytes(cfg, tokens, element)
    embeddings = tokens * INT64
    if cfg.positions == "rotary":
        # cos and sin, half a head each, per block
        positions = 0 if checkpointing else cfg.layers * seq_len * (cfg.width // cfg.heads) * element
    else:
        positions = seq_len * INT64
    return blocks + head + embeddings + positions
