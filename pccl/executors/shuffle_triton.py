"""The plan shuffle as one Triton kernel on GPUs (NVIDIA and AMD alike).

Block i of src (m elements) goes to block perm[i] of dst; blocks mapped to -1 stay put.
Each program copies one chunk of one block, with 64-bit offsets, so partial permutations
also take a single pass. Used when Triton is importable; pccl falls back to torch's
index_copy_ otherwise.
"""
from __future__ import annotations

from functools import lru_cache

import torch

CHUNK = 4096
MAX_CHUNKS = 65535  # the grid's second dimension


@lru_cache(maxsize=1)
def kernel():
    """The compiled kernel, or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def permute_blocks(src, dst, perm, m, CHUNK: tl.constexpr):
        row = tl.program_id(0)
        target = tl.load(perm + row)
        offsets = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        mask = offsets < tl.where(target >= 0, m, 0)  # unmapped blocks: nothing to copy
        values = tl.load(src + row.to(tl.int64) * m + offsets, mask=mask)
        tl.store(dst + target.to(tl.int64) * m + offsets, values, mask=mask)

    return permute_blocks


def permute_blocks(src: torch.Tensor, dst: torch.Tensor, perm: torch.Tensor) -> bool:
    """Run the kernel on (blocks, m) views of GPU tensors (of CPU tensors too under
    TRITON_INTERPRET=1, Triton's interpreter, which is how CI checks it); False when it
    cannot (no Triton, blocks too long for one grid), so the caller falls back."""
    fn = kernel()
    m = src.shape[1]
    chunks = -(-m // CHUNK)
    if fn is None or m == 0 or chunks > MAX_CHUNKS:
        return False
    fn[(src.shape[0], chunks)](src, dst, perm, m, CHUNK=CHUNK)
    return True
