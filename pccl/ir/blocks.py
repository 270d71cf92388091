"""Block layout of a collective's buffer. All-gather and reduce-scatter buffers have
equal blocks; an all-reduce buffer of n elements has uneven blocks (the first n % p blocks
one element longer), so no padding is ever needed."""
from __future__ import annotations


def block_offsets(count: int, blocks: int) -> list[int]:
    """Element offsets of `blocks` blocks over `count` elements, with the end: blocks + 1 values."""
    base, extra = divmod(count, blocks)
    return [i * base + min(i, extra) for i in range(blocks + 1)]
