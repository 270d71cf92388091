"""The engine's memory model (shard/planning/footprint.py): its model state against the engine's own
memory_report for every strategy, and its peak against the bytes a training step holds,
measured by a hook that sees every tensor torch allocates (a TorchDispatchMode that adds
each new storage's bytes and subtracts them when the storage is freed)."""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pccl.core.topology import Topology
from pccl.runtime.dry_run import DryRunCommunicator
from pccl.tuning import profiles
from shard.engine.engine import Engine
from shard.engine.strategy import STRATEGIES, Strategy
from shard.models.gpt import GPT, GPTConfig
from shard.planning.footprint import footprint, model_state, unit_sizes
from shard.planning.predict import next_token_loss


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("precision,reduce_dtype", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")])
def test_model_state_equals_the_engines_report_for_every_strategy(tied, precision, reduce_dtype):
    cfg = GPTConfig(vocab=1000, context=64, width=48, layers=3, heads=4, tied=tied)   # odd sizes: padding
    with torch.device("meta"):
        sizes = unit_sizes(GPT(cfg))
    comm = DryRunCommunicator(Topology.regular(8, 4), profiles.load("frontier"))
    for strategy in STRATEGIES:
        with torch.device("meta"):
            model = GPT(cfg)
        engine = Engine(model, comm, device="meta", init=lambda name, t: None, strategy=strategy, group_size=4,
                        precision=precision, reduce_dtype=reduce_dtype)
        report = engine.memory_report()
        engine.close()
        state = model_state(sizes, strategy, 8, 4, precision, reduce_dtype)
        assert state == {k: report[k] for k in ("parameters", "gradients", "optimizer")}, strategy


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages torch allocated while active and that are still alive, and
    the largest that sum reached (`peak`, which a caller may reset)."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                storage = t.untyped_storage()
                if id(storage) not in self.sizes:
                    self.sizes[id(storage)] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, id(storage))
        return out

    def _free(self, key: int) -> None:
        self.now -= self.sizes.pop(key)


@pytest.mark.parametrize("cfg", [GPTConfig(vocab=2048, context=128, width=128, layers=4, heads=4),
                                 GPTConfig(vocab=512, context=128, width=256, layers=4, heads=4)])
@pytest.mark.parametrize("strategy,precision,checkpointing", [
    ("zero3", "fp32", False), ("zero3", "fp32", True), ("zero3", "bf16", False), ("NGG", "bf16", False),
    ("NGG", "bf16", True)])
def test_the_peak_is_within_10_percent_of_a_measured_step(comm, engines, cfg, strategy, precision, checkpointing):
    """One rank, two micro-batches per step: the peak of the backward passes and of the
    whole step against the model's. The lanes run their collectives on the loop's thread
    (as they do over NCCL), so the hook, which sees one thread, sees them too."""
    micro_batch, seq = 2, 128
    with LiveBytes() as live:
        model = GPT(cfg)
        sizes = unit_sizes(model)
        engine = Engine(model, comm, strategy=strategy, precision=precision, reduce_dtype=precision,
                        activation_checkpointing=checkpointing)
        engines.append(engine)
        engine.gathers.inline = engine.reductions.inline = True
        tokens = torch.randint(0, cfg.vocab, (micro_batch, seq + 1), generator=torch.Generator().manual_seed(0))
        for step in range(2):   # the second step is measured: accumulators and caches exist
            live.peak = live.now
            for _ in range(2):
                engine.backward(next_token_loss(engine, tokens))
            backward = live.peak
            engine.step()
        del model
    f = footprint(cfg, sizes, Strategy.parse(strategy), 1, 1, micro_batch=micro_batch, seq_len=seq,
                  precision=precision, reduce_dtype=precision, checkpointing=checkpointing)
    state = sum(f.parts[k] for k in f.STATE)
    predicted_backward = state + max(f.moments["loss backward"], f.moments["unit backward"])
    assert 0.9 <= predicted_backward / backward <= 1.1, (predicted_backward, backward, f.moments)
    assert 0.9 <= f.peak / live.peak <= 1.1, (f.peak, live.peak, f.moments)


def test_a_world_of_one_keeps_no_copy_of_the_master_weights(comm, engines):
    """At world 1 no scope splits a buffer, and the parameters are the master weights: in
    fp32 every parameter is a view of them (nothing is gathered or copied); in bf16 no copy
    is kept either, and each unit's forward and backward cast its own (the cast is the
    gather), which is freed after, so the parameters cost one unit at a time, not the
    model. (tests/shard/test_engine_mpi.py checks on 2 ranks that each unit's gathered
    buffer is freed after its forward.)"""
    cfg = GPTConfig(vocab=256, context=32, width=64, layers=3, heads=4)
    tokens = torch.randint(0, cfg.vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    engine = Engine(GPT(cfg), comm, strategy="zero3", precision="fp32")
    engines.append(engine)
    engine.backward(next_token_loss(engine, tokens))
    engine.step()
    master = engine.optimizer.master.untyped_storage().data_ptr()
    assert engine.gather_stats["needed"] == 0 and all(u.full is None for u in engine.units)
    assert all(p.untyped_storage().data_ptr() == master for p in engine.model.parameters())
    assert engine.memory_report()["parameters"] == 0
    engine = Engine(GPT(cfg), comm, strategy="zero3", precision="bf16")
    engines.append(engine)
    engine.backward(next_token_loss(engine, tokens))
    engine.step()
    assert engine.gather_stats["needed"] == 2 * (len(engine.units) - 1)   # each block twice; the root's one cast
    assert all(u.full is None for u in engine.units if u is not engine.root)
    assert all(p.numel() == 0 for u in engine.units if u is not engine.root for p in u.flat.params)
    assert engine.memory_report()["parameters"] == 0
