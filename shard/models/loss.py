"""The language-model loss: the output head and the cross-entropy over the vocabulary,
fused and taken a chunk of tokens at a time, so the logits of the whole batch never
exist (in any dtype), nor their fp32 gradient.

Unfused, a micro-batch of N tokens over a vocabulary of V writes N x V logits in the
compute dtype, their fp32 copy and log-softmax's fp32 output, which the backward keeps
while it makes two more N x V fp32 gradients: about 12 N V bytes at once, 2.5 GB for
GPT-1.3B's micro-batch of 2 x 2048 tokens over 50,272 words and 12.6 GB for Llama 3 8B's
8192 tokens over 128,256 (shard/planning/footprint.py counted it so before this loss).
Here each chunk of rows makes its logits, their log-sum-exp and, when a gradient is
wanted, the gradient of the loss with respect to them (softmax minus the one-hot target),
which it turns at once into the chunk's input gradient and its share of the weight's;
the chunk's logits are then gone. The forward saves those two gradients for the backward
(N x d and V x d: the only tensors it keeps), which only scales them by the incoming
gradient, in place.

The dtypes are the unfused loss's: the logits in the matmul's dtype (autocast's where it
is on), made fp32 for the softmax as `F.cross_entropy(logits.float(), ...)` does, and their
gradient cast back to the logits' dtype before the products. The rounding differs in two
places: the softmax is exp(logits - max) / sum (log-softmax's backward rounds otherwise,
within fp32's rounding), and the weight's gradient is summed over the chunks in fp32,
where one matmul over all rows sums inside its kernel.

fp16 is the exception, for its range. The incoming gradient (a loss scale of 65536, above
fp16's largest value) multiplies in fp32 and rounds once; and where the logits are fp16,
the gradients kept are the summed loss's, the weight's in fp32, with the mean's 1 / n
applied with the incoming gradient: the unfused loss scales before it casts, so the small
entries of (softmax - one-hot) / n that fp16 cannot hold survive there, and here. The sum's
weight-gradient product, which could then pass fp16's range where no loss scale would lower
it, divides by a power of two that keeps it within (`_fp16_weight_gradient`).
"""
from __future__ import annotations

import torch

# Rows per chunk: as many tokens as make CHUNK_ELEMENTS logits (128 MB in fp32), so the
# matmuls stay large (GPT-1.3B: 667 rows of 50,272) and the transient small.
CHUNK_ELEMENTS = 1 << 25


def chunk_rows(vocab: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, chunk_elements // vocab)


# The device types autocast has (not "meta"), asked once here: torch 2.11's dynamo cannot
# trace torch.amp.is_autocast_available, and a compiled head broke its graph at the loss.
AUTOCAST_DEVICES = frozenset(d for d in ("cpu", "cuda", "xpu", "hpu", "mps", "mtia")
                             if torch.amp.is_autocast_available(d))


def logits_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of x @ weight.T here: autocast's where it is on, else the operands'."""
    device = x.device.type
    if device in AUTOCAST_DEVICES and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(x.dtype, weight.dtype)


def _chunk(xs, weight, ts, n: int, grad_x, grad_w) -> torch.Tensor:
    """The summed loss of one chunk of rows, and where wanted, its share of the gradients of
    the loss summed and divided by `n`, written into grad_x (its rows) and added to grad_w.
    A function of its own, so the chunk's logits are freed when it returns, before the next
    chunk makes its own."""
    logits = torch.matmul(xs, weight.t())   # autocast's dtype where it is on
    dtype = logits.dtype
    picked = logits.gather(1, ts[:, None]).squeeze(1).float()
    logits = logits.float()
    # log-sum-exp in place (torch.logsumexp would allocate a chunk-sized temporary): the
    # logits become exp(logits - max), then, divided by their sum, the softmax
    top = logits.amax(dim=1, keepdim=True)
    exp = logits.sub_(top).exp_()
    sums = exp.sum(dim=1, keepdim=True)
    loss = (sums.log() + top).squeeze(1).sub_(picked).sum()
    if grad_x is None and grad_w is None:
        return loss
    # d(loss / n)/d(logits) = (softmax - one-hot) / n, in fp32, then in the logits' dtype,
    # as the unfused backward casts it back through .float()
    grad = exp.div_(sums * n)
    grad[torch.arange(grad.shape[0], device=grad.device), ts] -= 1.0 / n
    grad = grad.to(dtype)
    del exp, logits
    # (under autocast the products take the weight's cached cast, as the logits' did)
    if grad_x is not None:
        grad_x.copy_(torch.matmul(grad, weight))
    if grad_w is not None:
        if dtype == torch.float16:
            grad_w += _fp16_weight_gradient(grad, xs)
        else:
            grad_w += torch.matmul(grad.t(), xs)
    return loss


def _fp16_weight_gradient(grad: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """grad.t() @ xs in fp32, from an fp16 product that cannot overflow. fp16's gradient is
    the summed loss's (the mean's 1 / n comes with the backward's loss scale), so a column
    of the product sums up to len(xs) entries of |grad| <= 1 times xs, which passes fp16's
    65504 where the rows share a target and the activations are large (no loss scale can
    then lower it: the step is skipped forever). A power of two that keeps the bound
    len(xs) * max|xs| within range divides grad first and multiplies the fp32 result again
    (1 where the product fits: the same bits as unscaled), computed on the device: no sync."""
    bound = xs.detach().abs().amax().float() * xs.shape[0]
    # (2**14 at most, which fp16 holds; an inf or NaN activation, whose step is skipped: 1)
    shift = torch.exp2(torch.ceil(torch.log2(bound / 32768.0)).nan_to_num_(0.0, 14.0).clamp_(0.0, 14.0))
    return torch.matmul((grad / shift.to(grad.dtype)).t(), xs).float().mul_(shift)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int,
                grads: bool) -> torch.Tensor:
        n = x.shape[0]
        # fp16 holds nothing below 6e-8: the mean's gradient (softmax - one-hot) / n of a
        # large batch would lose its small entries before the loss scale, which only the
        # backward brings, could lift them. In fp16 the gradients kept are the sum's (/ 1),
        # the weight's in fp32, and the backward applies 1 / n with the incoming gradient.
        sums = logits_dtype(x, weight) == torch.float16
        ctx.divisor = 1 if sums else n
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if grads and ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if grads and ctx.needs_input_grad[1] else None
        for start in range(0, n, rows):
            end = start + rows
            total += _chunk(x[start:end], weight, targets[start:end], ctx.divisor,
                            None if grad_x is None else grad_x[start:end], grad_w)
        if grad_w is not None and not sums:
            grad_w = grad_w.to(weight.dtype)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.n, ctx.weight_dtype = n, weight.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # scaled in place (a gradient accumulation's 1/micro-batches, a loss scale): a second
        # backward through the same loss finds them changed, and autograd says so
        grad_x, grad_w = ctx.saved_tensors
        factor = grad_out.float() * (ctx.divisor / ctx.n)   # the mean's 1 / n where the forward left it
        return scaled(grad_x, factor), scaled(grad_w, factor, ctx.weight_dtype), None, None, None


def scaled(g, factor: torch.Tensor, dtype=None):
    """g times `factor`, in place, then in `dtype` where given. An fp16 g is multiplied in
    fp32 and rounded once (a loss scale of 65536 cast to fp16 first would be inf), a block
    of rows at a time, so the fp32 transient stays small; fp32 and bf16 (fp32's range, and
    the engine's factor of 1: exact) multiply in place, with no copy."""
    if g is None:
        return None
    if g.dtype != torch.float16:
        g.mul_(factor)
    else:
        rows = max(1, CHUNK_ELEMENTS // max(1, g[0].numel()))
        for a in range(0, g.shape[0], rows):
            g[a:a + rows].copy_(g[a:a + rows].float().mul_(factor))
    return g if dtype is None else g.to(dtype)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         rows: int | None = None) -> torch.Tensor:
    """The mean cross-entropy of the logits `x @ weight.T` against `targets`, computed
    `rows` rows at a time (by default: CHUNK_ELEMENTS logits a chunk). x: (..., d),
    weight: (V, d), targets: integer class indices of x's leading shape."""
    if x.shape[:-1] != targets.shape:
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not match the inputs' leading shape "
                         f"{tuple(x.shape[:-1])} (inputs {tuple(x.shape)})")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be (vocab, {x.shape[-1]}) for inputs of width {x.shape[-1]}, got "
                         f"{tuple(weight.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must hold integer class indices, got {targets.dtype}")
    if targets.numel() == 0:
        raise ValueError("no targets: the mean cross-entropy of zero tokens is undefined")
    rows = chunk_rows(weight.shape[0]) if rows is None else rows
    if not (isinstance(rows, int) and rows >= 1):
        raise ValueError(f"rows must be a positive integer, got {rows!r}")
    # gradients are made in the forward only where a backward can follow
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    try:
        return _LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, targets.reshape(-1).long(), rows,
                                         grads)
    except (IndexError, RuntimeError) as e:   # the gather's, on the host (a GPU's asserts on the device);
        if "out of bounds" not in str(e):     # checked before, the range would wait for the device
            raise
        raise ValueError(f"targets must be class indices in [0, {weight.shape[0]}) (the vocabulary; there is no "
                         f"ignore_index: every position counts): {e}") from None


def next_token_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]: the model
    (or an engine holding it) takes the targets and computes the loss itself."""
    return model(tokens[:, :-1], targets=tokens[:, 1:])


__all__ = ["linear_cross_entropy", "next_token_loss", "chunk_rows", "CHUNK_ELEMENTS"]
