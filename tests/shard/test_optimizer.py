"""ShardedAdamW's parts against torch's own: global-norm clipping (clip_grad_norm_, at a
norm above the limit and below it), fp16's loss scale (GradScaler's update, with the
documented floor of 1), and the stretches weight decay applies to (any pattern of decayed
and undecayed parameters, one element wide too)."""
import random

import pytest
import torch

from shard import Engine, ShardedAdamW
from shard.engine.adamw import FlatAdamW, _stretches
from shard.engine.optimizer import LossScaler
from tests.shard.engine_models import MLP, mlp_batch, mlp_loss
from tests.shard.reference import HYPER, reference_optimizer


@pytest.mark.parametrize("clip", [0.5, 50.0])
def test_clipping_is_torchs_below_and_above_the_norm(comm, engines, clip):
    """The MLP's gradient norms lie between the two limits (asserted): at 0.5 every step is
    scaled down, at 50 none may be scaled (up, or at all)."""
    torch.manual_seed(0)
    model, reference = MLP(), MLP()
    reference.load_state_dict(model.state_dict())
    engine = Engine(model, comm, strategy="zero3", min_shard_numel=0, units=model.units())
    engines.append(engine)
    optimizer = ShardedAdamW(engine, grad_clip=clip, **HYPER)
    torch_optimizer = reference_optimizer(reference)
    for step in range(4):
        x, y = mlp_batch(step, 8)
        engine.backward(mlp_loss(engine(x), y))
        result = optimizer.step()
        torch_optimizer.zero_grad()
        mlp_loss(reference(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip).item()
        torch_optimizer.step()
        assert 0.5 < norm < 50.0, "the gradient norm must lie between the limits tested"
        assert result.grad_norm == pytest.approx(norm, rel=1e-5)
    ours = engine.full_state_dict()
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(ours[k], v, rtol=1e-5, atol=1e-6)


def test_the_loss_scale_follows_torchs_gradscaler_and_stops_at_1():
    """Overflow, 3 clean steps, overflow, 4 clean (a growth at the 4th), then 20 overflows
    in a row, down to the floor: every branch of the update, against torch's own kernel."""
    pattern = [1, 0, 0, 0, 1, 0, 0, 0, 0] + [1] * 20
    scaler = LossScaler(True, "cpu", init=2.0 ** 16, growth_interval=4)
    scale, tracker = torch.tensor([2.0 ** 16]), torch.zeros(1, dtype=torch.int32)
    ours, torchs = [], []
    for found in pattern:
        scaler.update(torch.tensor(float(found)))
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(found)]), 2.0, 0.5, 4)
        scale.clamp_(min=1.0)   # the documented floor; GradScaler has none
        ours.append(scaler.scale)
        torchs.append(scale.item())
    assert ours == torchs
    assert ours[8] == 2 * ours[7] and ours[-1] == 1.0   # it grew at the 4th clean step, and met the floor
    assert not LossScaler(False, "cpu").enabled and LossScaler(False, "cpu").factor == 1.0


def test_weight_decay_stretches_cover_the_shard_whatever_the_pattern():
    """Every element lies in exactly one stretch, in the decayed ones exactly where a
    decayed span holds it: random spans, adjacent, overlapping none, one element wide,
    and empty ones, against an element-by-element mask."""
    rng = random.Random(0)
    for _ in range(500):
        numel = rng.randint(1, 40)
        cuts = sorted(rng.sample(range(numel + 1), rng.randint(0, min(numel + 1, 12))))
        spans = [(a, b) for a, b in zip(cuts, cuts[1:]) if rng.random() < 0.5] + [(3, 3)] * rng.randint(0, 1)
        on, off = _stretches([s for s in spans if s[1] <= numel], numel)
        decayed = [any(a <= i < b for a, b in spans) for i in range(numel)]
        covered = sorted(i for a, b in on + off for i in range(a, b))
        assert covered == list(range(numel)), (spans, on, off)
        assert [any(a <= i < b for a, b in on) for i in range(numel)] == decayed, (spans, on, off)


def test_a_one_element_parameter_between_decayed_ones_is_trained_as_torch_trains_it():
    torch.manual_seed(0)
    tensors = [torch.randn(4), torch.randn(1), torch.randn(4)]   # decayed, not, decayed
    reference = [torch.nn.Parameter(t.clone()) for t in tensors]
    adamw = FlatAdamW(torch.cat(tensors), [(0, 4), (5, 9)], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch_adamw = torch.optim.AdamW([{"params": [reference[0], reference[2]]},
                                     {"params": [reference[1]], "weight_decay": 0.0}],
                                    lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        grads = [torch.randn(4), torch.randn(1), torch.randn(4)]
        adamw.step(1e-2, [torch.cat(grads)])
        for p, g in zip(reference, grads):
            p.grad = g
        torch_adamw.step()
    torch.testing.assert_close(adamw.master, torch.cat([p.detach() for p in reference]), rtol=1e-6, atol=1e-7)
