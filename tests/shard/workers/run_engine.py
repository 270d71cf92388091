"""mpiexec worker for the engine: runs one scenario and writes a JSON report (rank 0).

Usage: mpiexec -n P python -m tests.shard.workers.run_engine SCENARIO [ARG] REPORT.json
  equivalence GROUP   every strategy against single-process AdamW; memory and traffic; state_dict round trip
  save DIR            train, save a checkpoint, record what a loader must reproduce
  load DIR            load DIR's checkpoint (another world size and strategy), continue
  single DIR          one rank: crash mid-save, fp16 overflow, bad input
"""
from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path

import torch

import pccl
import shard
from pccl.tuning import self_calibration
from shard import Engine, ShardedAdamW
from shard.engine import checkpoint
from tests.shard import reference
from tests.shard.engine_models import MLP, TinyTransformer, mlp_loss, token_loss
from tests.shard.reference import MICRO, MODELS, RUNS, STEPS, compared, relative_error, sharded

torch.set_num_threads(1)
warnings.simplefilter("ignore")
comm = pccl.init()
N, RANK = comm.size, comm.rank


def global_batch(kind: str, step: int, ranks: int = N, micro: int = MICRO):
    return reference.global_batch(kind, step, ranks, micro)


def my_micro_batch(batch, j: int, ranks: int = N, rank: int = RANK):
    return reference.my_micro_batch(batch, j, ranks, rank)


def reference_run(kind: str, steps: int, clip, seed: int = 0):
    return reference.reference_run(kind, steps, clip, N, seed=seed)


def engine_run(kind: str, strategy, steps: int, group: int, clip=None, **options):
    torch.manual_seed(0)
    model = MODELS[kind][0]()
    engine, optimizer = sharded(model, comm, clip, strategy=strategy, group_size=group, units=model.units(),
                                min_shard_numel=0, **options)
    losses = []
    for step in range(steps):
        batch = global_batch(kind, step)
        total = 0.0
        for j in range(MICRO):
            x, y = my_micro_batch(batch, j)
            loss = MODELS[kind][2](engine(x), y)
            engine.backward(loss)
            total += loss.item()
        optimizer.step()
        losses.append(sum(comm_sum([total])) / (N * MICRO))
    return engine, optimizer, losses


def comm_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    comm.all_reduce(t)
    return t.tolist()


def equivalence(group: int) -> dict:
    report = {}
    references = {(kind, clip): reference_run(kind, STEPS, clip) for kind in MODELS for clip in (None, 0.5)}
    bf16_reference = reference_run("mlp", 5, None)
    for strategy in shard.STRATEGIES:
        name = strategy.letters
        for kind, clip, options in RUNS:
            label = f"{name}/{kind}/clip={clip}/{options}"
            try:
                engine, _, losses = engine_run(kind, strategy, STEPS, group, clip, **options)
                state = engine.full_state_dict()
                if RANK == 0:
                    report[label] = compared(losses, state, references[(kind, clip)])
                engine.close()
            except Exception:  # noqa: BLE001 - reported
                report[label] = {"exception": traceback.format_exc()}
        # Accounting: ring everywhere (PaRO's Table 3 assumes rings), s = 1 and s = 2.
        for micro in (1, 2):
            torch.manual_seed(0)
            model = MLP()
            engine, optimizer = sharded(model, comm, strategy=strategy, group_size=group, units=model.units(),
                                        min_shard_numel=0, algorithm="ring")
            batch = global_batch("mlp", 0, micro=micro)
            for j in range(micro):
                x, y = my_micro_batch(batch, j)
                engine.backward(mlp_loss(engine(x), y))
            optimizer.step()
            sent = engine.comm_report()
            totals = comm_sum([sent[s][k] for s in ("forward", "backward", "update") for k in ("intra", "inter")])
            if RANK == 0:
                report[f"{name}/traffic/s={micro}"] = dict(zip(
                    [f"{s}.{k}" for s in ("forward", "backward", "update") for k in ("intra", "inter")], totals))
                report[f"{name}/memory"] = {k: v for k, v in engine.memory_report().items() if k != "units"}
            engine.close()
        if name in ("NNN", "GGG", "IIG"):  # bf16 compute against the fp32 reference
            engine, _, losses = engine_run("mlp", strategy, 5, group, precision="bf16")
            if RANK == 0:
                report[f"{name}/bf16"] = {"losses": losses, "reference": bf16_reference[0]}
            engine.close()
        if name == "GGG":
            report_bf16_gathers(report)
            report_prefetch(report)
            report_reshard(report, group)
        grad_norms, states = round_trip(strategy, group)
        if RANK == 0:
            report[f"{name}/round_trip"] = {"grad_norms": grad_norms, "max_diff": max(
                (states[0][k] - states[1][k]).abs().max().item() for k in states[0])}
    return report


def report_prefetch(report: dict) -> None:
    """ZeRO-3's gathers with and without prefetch: the orders are known from the second
    iteration on; then every unit but the first of each pass finds its gather already
    started (at one rank nothing is sharded, so nothing is gathered)."""
    x, y = my_micro_batch(global_batch("mlp", 0), 0)
    for prefetch in (0, 1):
        torch.manual_seed(0)
        model = MLP()
        engine, optimizer = sharded(model, comm, strategy="zero3", prefetch=prefetch, units=model.units(),
                                    min_shard_numel=0)
        for _ in range(2):
            engine.backward(mlp_loss(engine(x), y))
            optimizer.step()
        report[f"gathers/prefetch={prefetch}"] = engine.comm_report()["gathers"]
        engine.close()


def report_reshard(report: dict, group: int) -> None:
    """ZeRO-3 with each unit's gathered parameters kept from its forward to its backward
    (reshard_after_forward=False) and released and gathered again (the default): whether
    the losses and final parameters are the same bit for bit, the bytes each stage sent
    (ring, summed over ranks), the gathers counted, and those of one step with prefetch
    capped at two units' bytes (the orders known from the step before)."""
    runs = {}
    for reshard in (True, False):
        engine, _, losses = engine_run("mlp", "zero3", STEPS, group, algorithm="ring", reshard_after_forward=reshard)
        sent = engine.comm_report()
        runs[reshard] = losses, engine.full_state_dict(), comm_sum(
            [sent[s]["intra"] + sent[s]["inter"] for s in ("forward", "backward", "update")]), sent["gathers"]
        engine.close()
    capped = {}
    for reshard in (True, False):
        torch.manual_seed(0)
        model = MLP()
        engine, optimizer = sharded(model, comm, strategy="zero3", units=model.units(), min_shard_numel=0,
                                    reshard_after_forward=reshard,
                                    prefetch_bytes=2 * 4 * (max(sum(p.numel() for p in u.parameters())
                                                                for u in model.units()) + N))
        x, y = my_micro_batch(global_batch("mlp", 0), 0)
        for step in range(2):
            engine.comm_report(reset=True)
            engine.backward(mlp_loss(engine(x), y))
            optimizer.step()
        capped[reshard] = engine.comm_report()["gathers"]
        engine.close()
    if RANK == 0:
        (losses, state, traffic, gathers), (kept_losses, kept_state, kept_traffic, kept_gathers) = \
            runs[True], runs[False]
        report["reshard"] = {"same_losses": losses == kept_losses,
                             "same_state": all(torch.equal(state[k], kept_state[k]) for k in state),
                             "released": traffic, "kept": kept_traffic,
                             "gathers": {"released": gathers, "kept": kept_gathers},
                             "capped": {"released": capped[True], "kept": capped[False]}}


def report_bf16_gathers(report: dict) -> None:
    """ZeRO-3 in bf16: the dtypes its all-gathers move in a step (the parameter shards are
    kept in the compute dtype, so the gathers carry 2-byte elements), and whether each
    unit's gathered buffer is freed after its forward (autograd keeps its views by place)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = TinyTransformer()
    engine, optimizer = sharded(model, comm, strategy="zero3", precision="bf16", units=model.units(),
                                min_shard_numel=0, prefetch=0)
    buffers = []
    for u in engine.units:
        if u is not engine.root and u.gathers_params:   # after the engine's own hook has gathered
            u.unit.module.register_forward_pre_hook(
                lambda *a, u=u: buffers.append(weakref.ref(u.full.untyped_storage())))
    engine.gathers.log = []
    x, y = my_micro_batch(global_batch("transformer", 0), 0)
    loss = token_loss(engine(x), y)
    gc.collect()
    freed = [b() is None for b in buffers]
    engine.backward(loss)
    optimizer.step()
    if RANK == 0:
        report["GGG/bf16_gathers"] = {"dtypes": sorted({str(c[3]) for c in engine.gathers.log if c[1] == "all_gather"}),
                                      "gathers": sum(c[1] == "all_gather" for c in engine.gathers.log),
                                      "freed": freed, "units": len(engine.units) - (engine.root is not None)}
    engine.close()


def round_trip(strategy, group: int):
    """A trained engine's and optimizer's state_dict() into a fresh pair with other initial
    values, then one more step on both: their gradient norms and parameters (rank 0), which
    must agree."""
    engine, optimizer, _ = engine_run("transformer", strategy, 2, group, clip=0.5)
    torch.manual_seed(1)
    model = TinyTransformer()
    fresh = sharded(model, comm, 0.5, strategy=strategy, group_size=group, units=model.units(), min_shard_numel=0)
    fresh[0].load_state_dict(engine.state_dict())   # views of the live state: before it steps on
    fresh[1].load_state_dict(optimizer.state_dict())
    grad_norms, states = [], []
    for e, o in ((engine, optimizer), fresh):
        batch = global_batch("transformer", 2)
        for j in range(MICRO):
            x, y = my_micro_batch(batch, j)
            e.backward(token_loss(e(x), y))
        grad_norms.append(o.step().grad_norm)
        states.append(e.full_state_dict())
        e.close()
    return grad_norms, states


def save_scenario(directory: Path) -> dict:
    """p ranks, IIG: two steps, save, one more step; what a loader must reproduce."""
    engine, optimizer, _ = engine_run("transformer", "paro-iig", 2, 2)
    checkpoint.save(engine, optimizer, directory / "ckpt")
    state = engine.full_state_dict()
    batch = global_batch("transformer", 2)
    for j in range(MICRO):
        x, y = my_micro_batch(batch, j)
        engine.backward(token_loss(engine(x), y))
    optimizer.step()
    after = engine.full_state_dict()
    if RANK == 0:
        torch.save({"saved": state, "after": after}, directory / "expected.pt")
    files = sorted(p.name for p in (directory / "ckpt").rglob("*") if p.is_file())
    return {"files": files}


def load_scenario(directory: Path) -> dict:
    """Another world size and strategy: restore exactly, continue the same trajectory."""
    torch.manual_seed(1)   # different initial values: everything must come from the checkpoint
    model = TinyTransformer()
    engine, optimizer = sharded(model, comm, strategy="zero3", group_size=1, units=model.units(), min_shard_numel=0)
    checkpoint.load(engine, optimizer, directory / "ckpt")
    restored = engine.full_state_dict()
    # The global batch of step 2 split over this world (micro-batches sized to match).
    saved_world, saved_micro = 4, MICRO
    batch = global_batch("transformer", 2, ranks=saved_world, micro=saved_micro)
    micro = saved_world * saved_micro // N
    for j in range(micro):
        x, y = my_micro_batch(batch, j)
        engine.backward(token_loss(engine(x), y))
    optimizer.step()
    after = engine.full_state_dict()
    report = {"steps": optimizer.steps}
    if RANK == 0:
        expected = torch.load(directory / "expected.pt")
        report["restored_max_diff"] = max((restored[k] - v).abs().max().item() for k, v in expected["saved"].items())
        report["after_error"] = relative_error(after, expected["after"])
    try:
        checkpoint.load(*sharded(MLP(), comm, strategy="zero3", min_shard_numel=0), directory / "ckpt")
        report["wrong_model"] = "loaded"
    except shard.CheckpointError as e:
        report["wrong_model"] = str(e)
    try:   # the same parameter names, other shapes
        wider = TinyTransformer(width=32)
        checkpoint.load(*sharded(wider, comm, strategy="zero3", units=wider.units(), min_shard_numel=0),
                        directory / "ckpt")
        report["wrong_shapes"] = "loaded"
    except shard.CheckpointError as e:
        report["wrong_shapes"] = str(e)
    return report


def single_scenario(directory: Path) -> dict:
    report = {}
    engine, optimizer, _ = engine_run("mlp", "zero3", 1, 1)
    checkpoint.save(engine, optimizer, directory / "ckpt")
    before = engine.full_state_dict()
    x, y = my_micro_batch(global_batch("mlp", 5), 0)
    engine.backward(mlp_loss(engine(x), y))
    optimizer.step()
    real_save = torch.save

    def crash(obj, f, *args, **kwargs):
        raise OSError("disk full (simulated crash mid-save)")
    torch.save = crash
    try:
        checkpoint.save(engine, optimizer, directory / "ckpt")
        report["crash"] = "no crash"
    except OSError as e:
        report["crash"] = str(e)
    finally:
        torch.save = real_save
    fresh = MLP()
    loader, loader_optimizer = sharded(fresh, comm, strategy="zero3", units=fresh.units(), min_shard_numel=0)
    checkpoint.load(loader, loader_optimizer, directory / "ckpt")
    restored = loader.full_state_dict()
    report["after_crash_max_diff"] = max((restored[k] - v).abs().max().item() for k, v in before.items())

    # fp16: an overflowing gradient skips the step and halves the loss scale.
    torch.manual_seed(0)
    model = MLP()
    engine, optimizer = sharded(model, comm, strategy="zero3", precision="fp16", units=model.units(), min_shard_numel=0)
    start = engine.full_state_dict()
    scale = optimizer.scaler.scale
    engine.backward(mlp_loss(engine(x), y) * 1e30)
    result = optimizer.step()
    unchanged = max((engine.full_state_dict()[k] - v).abs().max().item() for k, v in start.items())
    report["fp16_overflow"] = {"skipped": result.skipped, "scale_before": scale, "scale_after": result.loss_scale,
                               "unchanged": unchanged, "skipped_steps": optimizer.skipped_steps}

    errors = {}
    cases = {
        "unknown": lambda: Engine(MLP(), comm, strategy="zero9"),
        "principle": lambda: Engine(MLP(), comm, strategy="GGI"),
        "group": lambda: Engine(MLP(), comm, strategy="mics", group_size=3),
        "nested_units": lambda: (lambda m: Engine(m, comm, units=[m.blocks[0], m.blocks[0].fc]))(MLP()),
        "precision": lambda: Engine(MLP(), comm, precision="fp8"),
        "lr": lambda: ShardedAdamW(Engine(MLP(), comm), lr=-1),
        "lr_to_engine": lambda: Engine(MLP(), comm, lr=1e-3),
        "not_an_engine": lambda: ShardedAdamW(MLP()),
        "not_a_comm": lambda: Engine(MLP(), "world"),
        "step_first": lambda: ShardedAdamW(Engine(MLP(), comm, min_shard_numel=0)).step(),
        "bad_loss": lambda: (lambda e: e.backward(e(torch.randn(2, 7))))(Engine(MLP(), comm, min_shard_numel=0)),
        "no_checkpoint": lambda: checkpoint.load(*sharded(MLP(), comm), directory / "nothing-here"),
    }
    for name, case in cases.items():
        try:
            case()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - the type and message are the result
            errors[name] = f"{type(e).__name__}: {e}"
    report["errors"] = errors
    return report


def main() -> None:
    scenario, *args, out = sys.argv[1:]
    if scenario == "equivalence":
        report = equivalence(int(args[0]))
        # the engine's default algorithm, auto, decided with measured figures on 2+ ranks
        report["calibrated_shapes"] = len(self_calibration.ledger())
    else:
        directory = Path(args[0])
        report = {"save": save_scenario, "load": load_scenario, "single": single_scenario}[scenario](directory)
    if RANK == 0:
        Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
