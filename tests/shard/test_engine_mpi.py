"""The engine on 1, 2 and 4 ranks (4 as 2 groups of 2), against independent references:

- every strategy of PaRO's Table 1, an MLP and a tiny transformer (tied embedding, loose
  parameter), 3 steps of 2 micro-batches each, with and without clipping, prefetch,
  activation checkpointing and the transport's native collectives: the same parameters
  as single-process torch.optim.AdamW on the whole global batch (relative error <= 1e-5,
  in norm per tensor; eps 1e-6 keeps Adam from amplifying the rounding noise of
  gradient elements that are zero up to rounding, see run_engine.HYPER);
- bf16 compute: the loss curve within 2% of the fp32 reference at every step;
- memory per rank against PaRO's Table 2, traffic per stage against Table 3 and Eq. 1;
- checkpoints: saved on 4 ranks with IIG, loaded on 2 with ZeRO-3, restored exactly and
  continued on the same trajectory; a crash mid-save; another model's checkpoint refused;
- every strategy's state_dict() loaded into a fresh engine steps exactly as the original;
- fp16 overflow skips the step; bad input raises clear errors.
"""
import pytest

from shard import STRATEGIES, Strategy
from shard.engine.strategy import grouped_reduce_scatter_saving
from tests.support.mpirun import report_of

pytestmark = pytest.mark.mpi

WORKER = "-m tests.shard.workers.run_engine"

_reports: dict = {}
CONFIGS = [(1, 1), (2, 1), (4, 2)]          # (ranks, group size)
TABLE3 = ("zero1", "zero2", "zero3", "mics", "paro-igg", "paro-iig", "paro-nig")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    def get(key, ranks, *args):
        return report_of(_reports, key, tmp_path_factory.mktemp(str(key[0])), ranks, WORKER, *args)
    return get


def equivalence(report, ranks, group):
    result = report(("equivalence", ranks), ranks, "equivalence", str(group))
    assert "_launch" not in result, result.get("_launch")
    return result


@pytest.mark.parametrize("ranks,group", CONFIGS, ids=[f"p{p}g{g}" for p, g in CONFIGS])
@pytest.mark.parametrize("strategy", [s.letters for s in STRATEGIES])
def test_every_strategy_matches_single_process_adamw(report, ranks, group, strategy):
    mine = {k: v for k, v in equivalence(report, ranks, group).items()
            if k.startswith(strategy + "/") and ("error" in v or "exception" in v)}
    assert len(mine) == 4
    for label, run in mine.items():
        assert "exception" not in run, f"{label}\n{run.get('exception')}"
        assert run["error"] <= 1e-5, (label, run)
        assert run["loss_error"] <= 1e-5, (label, run)
    # as shipped: the engine's default algorithm (auto) decided with the self-calibration's
    # figures wherever its communicators have peers; one rank has nothing to measure
    assert (equivalence(report, ranks, group)["calibrated_shapes"] > 0) == (ranks > 1)


@pytest.mark.parametrize("ranks,group", CONFIGS, ids=[f"p{p}g{g}" for p, g in CONFIGS])
@pytest.mark.parametrize("strategy", [s.letters for s in STRATEGIES])
def test_state_dict_round_trips_into_a_fresh_engine(report, ranks, group, strategy):
    run = equivalence(report, ranks, group)[f"{strategy}/round_trip"]
    assert run["max_diff"] == 0.0 and run["grad_norms"][0] == run["grad_norms"][1], run


@pytest.mark.parametrize("ranks,group", CONFIGS, ids=[f"p{p}g{g}" for p, g in CONFIGS])
@pytest.mark.parametrize("strategy", ["NNN", "GGG", "IIG"])
def test_bf16_loss_curve_follows_fp32(report, ranks, group, strategy):
    run = equivalence(report, ranks, group)[f"{strategy}/bf16"]
    for got, want in zip(run["losses"], run["reference"], strict=True):
        assert abs(got - want) <= 0.02 * want, run


@pytest.mark.parametrize("ranks,group", CONFIGS, ids=[f"p{p}g{g}" for p, g in CONFIGS])
@pytest.mark.parametrize("strategy", [s.letters for s in STRATEGIES])
def test_memory_matches_paro_table_2(report, ranks, group, strategy):
    memory = equivalence(report, ranks, group)[f"{strategy}/memory"]
    psi = memory["padded_numel"]
    assert psi % ranks == 0 and psi - memory["numel"] < ranks * 7   # 7 units, each padded to N
    # fp32 parameters and gradients in this run; K = 12 bytes of master weights and moments
    s = Strategy.parse(strategy)
    expected = s.memory_per_rank(psi, ranks, group, param_bytes=4, grad_bytes=4)
    if s.params.shards(ranks, group) == s.optimizer.shards(ranks, group):
        expected["parameters"] = 0   # Table 2's P is a copy of the master weights, which the engine does not keep
    if s.grads.shards(ranks, group) != s.optimizer.shards(ranks, group):
        # the G-scope accumulator of Table 2, and besides it the optimizer's fp32 gradient
        expected["gradients"] += 4 * psi / s.optimizer.shards(ranks, group)
    assert {k: memory[k] for k in ("parameters", "gradients", "optimizer")} == expected


@pytest.mark.parametrize("ranks,group", [(2, 1), (4, 2)], ids=["p2g1", "p4g2"])
def test_zero3_in_bf16_gathers_bf16_and_frees_each_units_gathered_buffer(report, ranks, group):
    run = equivalence(report, ranks, group)["GGG/bf16_gathers"]
    assert run["dtypes"] == ["torch.bfloat16"] and run["gathers"] >= 2 * run["units"], run
    assert len(run["freed"]) == run["units"] and all(run["freed"]), run


def table3(name: str, psi: float, n: int, m: int, s: int) -> dict:
    """PaRO's Table 3: elements sent in total over all N ranks, per stage, as
    (intra-group, inter-group). Rings over the whole world cross a group boundary at g of
    their N links, hence the g and N - g split of the global collectives.

    Corrections to the table as printed, each checked by the table's own other rows and
    by Eq. 1 (they vanish at s = 1 and g = 1, where the printed and corrected rows agree):
    - a collective among the g groups on an I shard (psi/M elements) sends (g-1)/g of it per
      rank, psi/N*(g-1), as the IIG and NIG rows write; the IGG reduce-scatter and the MiCS
      all-reduce write psi/M*(g-1), g times more; the MiCS all-reduce is all inter-group;
    - IGG's update all-gather runs once per step, not s times; NIG's intra-group
      reduce-scatter runs every micro-batch, s times.
    """
    g = n // m
    world = lambda times: ((n - g) * times * psi / n * (n - 1), g * times * psi / n * (n - 1))  # noqa: E731
    intra = lambda times: (n * times * psi / m * (m - 1), 0)                                     # noqa: E731
    inter = lambda times: (0, n * times * psi / n * (g - 1))                                     # noqa: E731
    add = lambda *parts: tuple(sum(x) for x in zip(*parts))                                      # noqa: E731
    zero = (0, 0)
    rows = {
        "zero1": (zero, zero, add(world(2), world(1))),
        "zero2": (zero, world(s), world(1)),
        "zero3": (world(s), add(world(s), world(s)), zero),
        "mics": (intra(s), add(intra(s), intra(s)), inter(2)),
        "paro-igg": (intra(s), add(intra(s), intra(s), inter(s)), inter(1)),
        "paro-iig": (intra(s), add(intra(s), intra(s)), add(inter(1), inter(1))),
        "paro-nig": (zero, intra(s), add(inter(1), inter(1), intra(1))),
    }
    return dict(zip(("forward", "backward", "update"), rows[name]))


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("name", TABLE3)
def test_traffic_matches_paro_table_3(report, name, micro):
    ranks, group = 4, 2
    run = equivalence(report, ranks, group)
    letters = Strategy.parse(name).letters
    sent, psi = run[f"{letters}/traffic/s={micro}"], run[f"{letters}/memory"]["padded_numel"]
    for stage, (intra, inter) in table3(name, psi, ranks, group, micro).items():
        assert sent[f"{stage}.intra"] == 4 * intra, (stage, sent)   # fp32: 4 bytes per element
        assert sent[f"{stage}.inter"] == 4 * inter, (stage, sent)


@pytest.mark.parametrize("micro", [1, 2])
def test_grouped_gradient_reduction_saves_paro_equation_1(report, micro):
    ranks, group = 4, 2
    run = equivalence(report, ranks, group)
    psi = run["NGG/memory"]["padded_numel"]

    def total(letters):
        return sum(run[f"{letters}/traffic/s={micro}"].values()) / 4

    saving = grouped_reduce_scatter_saving(psi, ranks, group, micro)
    assert saving == psi * (micro - 1) * (ranks // group - 1) / ranks          # Eq. 1's closed form
    assert total("NGG") - total("NIG") == ranks * saving                        # summed over all ranks
    assert total("IGG") - total("IIG") == ranks * saving


def test_ddp_all_reduces_once_per_step(report):
    run = equivalence(report, 4, 2)
    psi = run["NNN/memory"]["padded_numel"]
    for micro in (1, 2):
        sent = run[f"NNN/traffic/s={micro}"]
        assert sent["update.intra"] == sent["update.inter"] == 4 * 2 * 2 * psi / 4 * 3   # ring: 2(N-1)/N each
        assert sent["forward.intra"] == sent["backward.intra"] == sent["backward.inter"] == 0


def test_checkpoint_reshards_across_world_size_and_strategy(report, tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoint")
    saved = report_of(_reports, ("save",), directory, 4, WORKER, "save", str(directory))
    assert "_launch" not in saved, saved.get("_launch")
    assert "LATEST" in saved["files"] and "meta.json" in saved["files"]
    assert not [f for f in saved["files"] if f.endswith(".tmp")]
    loaded = report_of(_reports, ("load",), directory, 2, WORKER, "load", str(directory))
    assert "_launch" not in loaded, loaded.get("_launch")
    assert loaded["restored_max_diff"] == 0.0
    assert loaded["after_error"] <= 1e-5
    assert loaded["steps"] == 3
    assert "written for another model" in loaded["wrong_model"]
    assert "with other shapes" in loaded["wrong_shapes"]
    assert "('blocks.0.ln1.bias', [24], [32])" in loaded["wrong_shapes"]


@pytest.fixture(scope="module")
def single(report, tmp_path_factory):
    directory = tmp_path_factory.mktemp("single")
    result = report_of(_reports, ("single",), directory, 1, WORKER, "single", str(directory))
    assert "_launch" not in result, result.get("_launch")
    return result


def test_crash_mid_save_leaves_previous_checkpoint(single):
    assert "simulated crash" in single["crash"]
    assert single["after_crash_max_diff"] == 0.0


def test_fp16_overflow_skips_the_step_and_halves_the_scale(single):
    run = single["fp16_overflow"]
    assert run["skipped"] and run["skipped_steps"] == 1 and run["unchanged"] == 0.0
    assert run["scale_after"] == run["scale_before"] / 2


@pytest.mark.parametrize("ranks,group", CONFIGS, ids=[f"p{p}g{g}" for p, g in CONFIGS])
def test_prefetch_starts_each_gather_before_the_unit_runs(report, ranks, group):
    run = equivalence(report, ranks, group)
    units, passes, steps = 5, 2, 2    # MLP units; forward and backward; steps
    if ranks == 1:   # nothing sharded, nothing gathered
        assert run["gathers/prefetch=0"] == run["gathers/prefetch=1"] == {"needed": 0, "prefetched": 0}
        return
    assert run["gathers/prefetch=0"] == {"needed": units * passes * steps, "prefetched": 0}
    # the first step records the orders; then all but the first unit of each pass
    assert run["gathers/prefetch=1"] == {"needed": units * passes * steps, "prefetched": (units - 1) * passes}


@pytest.mark.parametrize("ranks,group", CONFIGS, ids=[f"p{p}g{g}" for p, g in CONFIGS])
def test_keeping_each_units_parameters_to_its_backward_trains_alike_and_gathers_once(report, ranks, group):
    """reshard_after_forward=False: the same losses and parameters as gathering again for
    the backward, bit for bit; the backward sends only the gradients' reductions, so its
    bytes fall by exactly the forward's gathers (every unit gathered once per micro-batch
    either way in the forward), and the update's are unchanged; the gathers counted are the
    forward's, and a prefetch cap counts only the gathers started ahead, not the units the
    forward kept behind."""
    run = equivalence(report, ranks, group)["reshard"]
    assert run["same_losses"] and run["same_state"]
    (forward, backward, update), kept = run["released"], run["kept"]
    assert kept[0] == forward and kept[2] == update
    assert backward - kept[1] == forward
    assert (forward > 0) == (ranks > 1)   # one rank gathers nothing
    gathers, capped = run["gathers"], run["capped"]
    units = 5   # the MLP's
    if ranks == 1:   # fp32 at world 1: nothing gathered, nothing counted
        assert gathers["kept"] == gathers["released"] == capped["kept"] == {"needed": 0, "prefetched": 0}
        return
    # kept: the backward gathers nothing, and counts nothing
    assert gathers["kept"]["needed"] * 2 == gathers["released"]["needed"]
    # prefetch capped at two units' bytes: every unit but the first finds its gather started,
    # whatever the forward kept behind it
    assert capped["kept"] == {"needed": units, "prefetched": units - 1}
    assert capped["released"] == {"needed": 2 * units, "prefetched": 2 * (units - 1)}


@pytest.mark.parametrize("case,expected", [
    ("unknown", "StrategyError: unknown strategy 'zero9'"),
    ("principle", "Principle 1"),
    ("group", "group size 3 does not divide the world size 1"),
    ("nested_units", "UnitError: units must not contain each other"),
    ("precision", "precision must be one of"),
    ("lr", "lr must be a positive number"),
    ("lr_to_engine", "unknown Engine settings ['lr']; expected fields of EngineConfig (['lr'] are settings of "
                     "OptimizerConfig, for ShardedAdamW)"),
    ("not_a_comm", "TypeError: comm must be a pccl.Communicator"),
    ("not_an_engine", "TypeError: engine must be a shard.Engine, got MLP"),
    ("step_first", "step() needs at least one backward()"),
    ("bad_loss", "backward() needs a scalar loss"),
    ("no_checkpoint", "CheckpointError: no checkpoint at"),
])
def test_bad_input_is_refused_clearly(single, case, expected):
    assert single["errors"][case] is not None and expected in single["errors"][case]
