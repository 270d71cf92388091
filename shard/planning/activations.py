"""Activation memory of the GPT model (shard/models/gpt.py) in training: the bytes autograd
keeps from the forward pass for the backward, at the end of the forward, per micro-batch
of b sequences of t tokens, with and without activation checkpointing.

Per token, e bytes per element of the compute dtype, width d, heads a, vocabulary V:

    a block                   16 d e  + 4 e + 4 a
        ln1's input d, its mean and 1/std (2), qkv's input d, q, k and v (one tensor,
        3d), attention's output d (proj's input: a view of it), ln2's input d, its
        statistics (2), up's input d, GELU's input 4d, down's input 4d; attention's
        log-sum-exp per head in fp32 (torch's CPU flash-attention kernel: no t x t scores)
        rotary positions: + 3 d e (the rotated q and k, and proj's input, now a copy)
    a checkpointed block      d e     (its input; one block is recomputed at a time)
    the head                  (2 d + 2) e, and V d e once
        the final norm's input and statistics; the loss, fused with the head
        (shard/models/loss.py), keeps its input's gradient and its weight's (in the weight's
        dtype: the compute dtype under the engine), and no logits
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


def block_bytes(cfg: GPTConfig, tokens: int, element: int, checkpointed: bool = False) -> int:
    """What one block keeps for `tokens` tokens of `element`-byte values."""
    d = cfg.width
    if checkpointed:
        return tokens * d * element
    per_token = (16 * d + 4 + (3 * d if cfg.positions == "rotary" else 0)) * element + FP32 * cfg.heads
    return tokens * per_token


def head_bytes(cfg: GPTConfig, tokens: int, element: int) -> int:
    """What the final norm, the head and the loss keep for `tokens` tokens."""
    return tokens * (2 * cfg.width + 2) * element + cfg.vocab * cfg.width * element


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
