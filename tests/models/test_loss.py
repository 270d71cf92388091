"""The fused head and cross-entropy (shard/models/loss.py) against the unfused loss: the
logits of the whole batch, made fp32, through torch's cross_entropy, and autograd."""
import pytest
import torch
import torch.nn.functional as F

from shard.models import GPT, GPTConfig, linear_cross_entropy, next_token_loss
from tests.shard.test_footprint import LiveBytes


def unfused(x, weight, targets):
    return F.cross_entropy((x @ weight.t()).float().flatten(0, -2), targets.flatten())


def gradients(loss_fn, x, weight, targets, scale: float):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = loss_fn(x, weight, targets)
    (loss * scale).backward()   # the incoming gradient of an accumulation or a loss scale
    return loss.detach(), x.grad, weight.grad


@pytest.mark.parametrize("rows", [1, 7, 64, 1000])   # one row a chunk, uneven chunks, all rows in one
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_fp32_loss_and_gradients_equal_the_unfused_loss(rows, scale):
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 33, 24, generator=g), torch.randn(301, 24, generator=g) * 0.3
    targets = torch.randint(0, 301, (2, 33), generator=g)
    reference = gradients(unfused, x, weight, targets, scale)
    fused = gradients(lambda *a: linear_cross_entropy(*a, rows=rows), x, weight, targets, scale)
    for got, want in zip(fused, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float16, False), (torch.float32, True)])
def test_narrow_dtypes_round_the_logits_gradient_as_the_unfused_loss(dtype, autocast):
    """The logits' fp32 gradient agrees to fp32 rounding, so once cast to the compute dtype
    an element may differ by one rounding of it; the weight's gradient sums its chunks in
    fp32 where the unfused matmul rounds once."""
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(64, 32, generator=g).to(dtype), (torch.randn(500, 32, generator=g) * 0.3).to(dtype)
    targets = torch.randint(0, 500, (64,), generator=g)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        reference = gradients(unfused, x, weight, targets, 1.0)
        fused = gradients(lambda *a: linear_cross_entropy(*a, rows=16), x, weight, targets, 1.0)
    narrow = torch.bfloat16 if autocast else dtype
    ulp = torch.finfo(narrow).eps
    torch.testing.assert_close(fused[0], reference[0], rtol=1e-6, atol=0)
    for got, want in zip(fused[1:], reference[1:]):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2 * ulp, atol=2 * ulp * want.abs().max().item())


@pytest.mark.parametrize("dtype,autocast", [(torch.float16, False), (torch.float32, True)])
def test_fp16_under_a_loss_scale_keeps_what_the_unfused_loss_keeps(dtype, autocast):
    """fp16 training's loss scale (the engine's starts at 65536, above fp16's largest value)
    reaches the gradients in fp32, and the small entries of (softmax - one-hot) / n of a
    large batch survive as they do unfused, where the scale multiplies before the cast:
    before, the scale cast to fp16 was inf, and the entries were cast, and lost, first."""
    g = torch.Generator().manual_seed(2)
    n, width, vocab = 2048, 32, 2048
    x, weight = (torch.randn(n, width, generator=g) * 0.5).to(dtype), (torch.randn(vocab, width, generator=g) * 0.02
                                                                        ).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    exact = gradients(unfused, x.double(), weight.double(), targets, 1.0)
    with torch.autocast("cpu", torch.float16, enabled=autocast):
        for scale in (65536.0, 32768.0):
            fused = gradients(lambda *a: linear_cross_entropy(*a, rows=256), x, weight, targets, scale)
            reference = gradients(unfused, x, weight, targets, scale)
            for got, want, truth in zip(fused[1:], reference[1:], exact[1:]):
                assert got.isfinite().all(), scale
                error = ((got.double() / scale - truth).norm() / truth.norm()).item()
                theirs = ((want.double() / scale - truth).norm() / truth.norm()).item()
                assert error <= 1.5 * theirs + 1e-6, (scale, error, theirs)


@pytest.mark.parametrize("scale", [1.0, 1024.0])
def test_fp16_weight_gradient_stays_finite_where_the_unfused_one_does(scale):
    """fp16's weight gradient is made from the summed loss's, whose product over a chunk's
    rows passed 65504 where many rows share a target and the activations are large (here
    by 8x): inf under every loss scale, so fp16 training skipped every step. The unfused
    loss, and now the fused one, give the finite gradient (within fp16's rounding)."""
    g = torch.Generator().manual_seed(3)
    n, width, vocab = 4096, 64, 2048
    x = (torch.randn(n, width, generator=g) + 40).half()
    weight = (torch.randn(vocab, width, generator=g) * 0.02).half()
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[: n // 2] = 0
    exact = gradients(unfused, x.double(), weight.double(), targets, 1.0)[2]
    fused = gradients(linear_cross_entropy, x, weight, targets, scale)[2]
    reference = gradients(unfused, x, weight, targets, scale)[2]
    assert reference.isfinite().all() and fused.isfinite().all()
    error = ((fused.double() / scale - exact).norm() / exact.norm()).item()
    theirs = ((reference.double() / scale - exact).norm() / exact.norm()).item()
    assert error <= 1.5 * theirs + 1e-4, (error, theirs)


def test_the_loss_traces_on_the_meta_device():
    """The planning tools count a step's FLOPs and bytes on the meta device, where autocast
    is not a question torch can answer."""
    x = torch.empty(2, 8, 16, device="meta", requires_grad=True)
    loss = linear_cross_entropy(x, torch.empty(50, 16, device="meta", requires_grad=True),
                                torch.zeros(2, 8, dtype=torch.int64, device="meta"))
    loss.backward()
    assert loss.device.type == "meta" and x.grad.shape == x.shape


def test_the_loss_compiles_whole_on_every_supported_torch():
    """torch 2.11's dynamo could not trace torch.amp.is_autocast_available, which the loss
    asked inside its autograd function: a compiled head then ran the loss outside its
    graph (2.13's traced it). CI runs this file on 2.11 too (make test-oldest-torch)."""
    import warnings

    x = torch.randn(8, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (8,))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Dynamo does not know how to trace")
        loss = torch.compile(linear_cross_entropy, backend="eager", fullgraph=True)(x, weight, targets)
        loss.backward()
    torch.testing.assert_close(loss, F.cross_entropy(x @ weight.t(), targets))


def test_the_logits_of_the_whole_batch_never_exist():
    """The largest tensor made is a chunk's logits, not the batch's."""
    vocab, rows, tokens = 4096, 32, 512
    x = torch.randn(tokens, 16, requires_grad=True)
    weight = torch.randn(vocab, 16, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    with LiveBytes() as live:
        base = live.now
        linear_cross_entropy(x, weight, targets, rows=rows).backward()
    # kept: both gradients (x's, and the weight's fp32 sum); transient: one chunk's fp32 logits
    # and the chunk's weight-gradient product (the census also sees x and the weight, made
    # before it started)
    assert live.peak - base <= (2 * tokens * 16 + 3 * vocab * 16 + rows * vocab) * 4 + 16384   # and a few rows
    assert live.peak - base < tokens * vocab * 4 / 4


def test_no_gradient_is_made_without_a_backward_to_follow():
    x, weight = torch.randn(64, 16, requires_grad=True), torch.randn(2048, 16, requires_grad=True)
    targets = torch.randint(0, 2048, (64,))
    with torch.no_grad(), LiveBytes() as live:
        base = live.now
        loss = linear_cross_entropy(x, weight, targets, rows=8)
    # one chunk's logits (and x and the weight, which the census sees) and a few rows
    assert live.peak - base <= (8 * 2048 + x.numel() + weight.numel()) * 4 + 16384
    assert loss.item() == pytest.approx(unfused(x, weight, targets).item(), rel=1e-6)


def test_a_second_backward_through_the_same_loss_is_refused():
    x, weight = torch.randn(8, 4, requires_grad=True), torch.randn(10, 4, requires_grad=True)
    loss = linear_cross_entropy(x, weight, torch.randint(0, 10, (8,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_bad_input_is_named():
    x, weight = torch.randn(2, 5, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match=r"targets of shape \(2, 4\) do not match the inputs' leading shape \(2, 5\)"):
        linear_cross_entropy(x, weight, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"weight must be \(vocab, 8\)"):
        linear_cross_entropy(x, torch.randn(10, 7), torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer class indices"):
        linear_cross_entropy(x, weight, torch.zeros(2, 5))
    for bad in (-100, 10):   # Hugging Face's padding label; one past the vocabulary (were gather's IndexError)
        with pytest.raises(ValueError, match=rf"class indices in \[0, 10\) \(the vocabulary; there is no "
                                             rf"ignore_index: every position counts\): index {bad} is out of bounds"):
            linear_cross_entropy(x, weight, torch.full((2, 5), bad))
    with pytest.raises(ValueError, match="rows must be a positive integer"):
        linear_cross_entropy(x, weight, torch.zeros(2, 5, dtype=torch.long), rows=0)


@pytest.mark.parametrize("tied", [True, False])
def test_the_model_given_targets_returns_the_loss_of_its_logits(tied):
    cfg = GPTConfig(vocab=96, context=32, width=32, layers=2, heads=4, tied=tied)
    model = GPT(cfg, seed=3)
    tokens = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(4))
    loss = next_token_loss(model, tokens)
    loss.backward()
    fused = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    logits = model(tokens[:, :-1])
    reference = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
