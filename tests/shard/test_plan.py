"""The planner (shard/planning/planner.py): hand-checked cases, the command line, and strategy="auto"
in the engine."""
import json

import pytest
import torch
from mpi4py import MPI

import pccl
from pccl.tuning import profiles
from pccl.tuning.profiles import topology_for
from shard.engine.engine import Engine
from shard.engine.optimizer import ShardedAdamW
from shard.engine.strategy import Strategy
from shard.models import GPT, GPTConfig
from shard.models.loss import next_token_loss
from shard.planning.planner import Cluster, Job, PlanError, build_engine, make_plan, sized
from shard.planning.predict import ComputeRate, Workload
from shard.tools.strategy_plan import main

GIB = 1 << 30
PCCL_BATCH = 4 * 2 ** 20   # the PCCL paper's global batch, tokens (Section 5.2)


def cluster(profile: str, world: int, per_node: int, memory_gib: float, tflops: float) -> Cluster:
    p = profiles.load(profile)
    rate = ComputeRate(0.35 * tflops * 1e12, 32 / p.copy_bandwidth, "35% of peak")
    return Cluster(topology_for(world, p, per_node, None), p, int(memory_gib * GIB), rate, 0.1, tflops * 1e12)


def misses(candidates) -> set:
    return {(c.strategy.letters, c.group if c.strategy.uses_groups() else None) for c in candidates if not c.fits}


def test_gpt_7b_on_1024_frontier_gcds():
    """PCCL's 7B run (1024 MI250X GCDs of 64 GB, 4M-token batches of 2048-token sequences,
    one per micro-batch: 2 micro-batches per rank). DDP holds 16 bytes per parameter (PaRO's
    Table 2's 16, its gradients summed in fp32 and no bf16 copy of the parameters: they are
    the master weights, cast per use), 99 GiB for 6.66B: it cannot fit 57.6 GiB; nor can NNI in groups of 4,
    whose bf16 gradient accumulator is replicated (2 bytes per parameter) beside the fp32
    gradient of its quarter of the optimizer state (1 byte per parameter). ZeRO-3 holds
    16/1024 of DDP's. Among ZeRO-3 and the node-grouped PaRO strategies, ZeRO-3 is
    predicted fastest."""
    job = Job.for_global_batch(GPTConfig.preset("gpt_7b"), 1024, PCCL_BATCH, 2048, 1, precision="bf16")
    assert job.micro_batches == 2
    frontier = cluster("frontier", 1024, 8, 64, 191.5)
    candidates = sized(job, frontier)
    assert len(candidates) == 41 and misses(candidates) == {("NNN", None), ("NNI", 4)}
    psi = job.cfg.num_params()
    ddp = next(c for c in candidates if c.strategy.letters == "NNN")
    state = ddp.memory["parameters"] + ddp.memory["gradients"] + ddp.memory["optimizer"]
    assert state == pytest.approx(16 * psi, rel=1e-3) and state > frontier.usable
    zero3 = next(c for c in candidates if c.strategy.letters == "GGG")
    assert zero3.memory["optimizer"] == pytest.approx(12 * psi / 1024, rel=1e-3)
    plan = make_plan(job, frontier, strategies=("zero3", "IIG", "IGG"), groups=[8])
    assert plan.chosen.strategy.letters == "GGG" and plan.margin() > 0


def test_gpt_13b_on_1024_frontier_gcds():
    """13B likewise: ZeRO-1 keeps 2+2 bytes per parameter replicated, 48 GiB, and with
    13 GiB of activations misses 57.6 GiB; so do DDP, every NNI, and the I-scoped optimizer
    states of small groups."""
    job = Job.for_global_batch(GPTConfig.preset("gpt_13b"), 1024, PCCL_BATCH, 2048, 1, precision="bf16")
    candidates = sized(job, cluster("frontier", 1024, 8, 64, 191.5))
    assert misses(candidates) == {("NNN", None), ("NNG", None), ("NNI", 4), ("NNI", 8), ("NNI", 16), ("NNI", 32),
                                  ("NII", 4), ("NII", 8), ("INI", 4), ("INI", 8), ("III", 4)}
    zero1 = next(c for c in candidates if c.strategy.letters == "NNG").memory
    assert zero1["parameters"] + zero1["gradients"] == pytest.approx(4 * job.cfg.num_params(), rel=1e-3)


def test_a_comm_bound_65b_picks_paros_iig_as_the_paper_found():
    """PaRO's Figure 6(c): LLaMA-65B with activation checkpointing on 128 A100s of 80 GB
    (DGX nodes of 8, about 100 GB/s between nodes: Perlmutter's 4 NICs per node) fits only
    ZeRO-3 and the I-scoped P strategies, and PaRO-IIG beats ZeRO-3 (1.77x measured at 128
    GPUs). Here with 512-token sequences one per micro-batch, 40 per step, where the
    per-micro-batch global collectives of ZeRO-3 cannot hide behind the computation."""
    cfg = GPTConfig(vocab=32000, context=2048, width=8192, layers=80, heads=64, tied=False)
    job = Job(cfg, 512, 1, 40, precision="bf16", checkpointing=True, name="llama-65b-like")
    a100s = cluster("perlmutter", 128, 8, 80, 312)
    fitting = {c.strategy.letters for c in sized(job, a100s, groups=[8]) if c.fits}
    assert fitting == {"GGG", "IGG", "IIG", "GIG"}
    plan = make_plan(job, a100s, strategies=sorted(fitting), groups=[8])
    assert plan.chosen.strategy.letters == "IIG"
    assert plan.margin() > 0.1 and plan.runner_up.strategy.letters == "GGG"
    assert "paro-iig (groups of 8) is predicted fastest" in plan.reason()


def test_zero3_when_memory_allows_nothing_else_and_a_clear_error_when_nothing_fits():
    """13B on 64 A100s cut to 10 GB slices (MIG 1g.10gb), checkpointed: ZeRO-3's peak is
    the only one under 9 GiB usable; with 8 GB nothing fits, and the error names ZeRO-3 and
    the memory it needs."""
    job = Job.for_global_batch(GPTConfig.preset("gpt_13b"), 64, 64 * 2048 * 2, 2048, 1, precision="bf16",
                               checkpointing=True, name="gpt_13b")
    tight = cluster("perlmutter", 64, 4, 10, 312)
    candidates = sized(job, tight)
    assert [c.strategy.letters for c in candidates if c.fits] == ["GGG"]
    plan = make_plan(job, tight, strategies=("zero3", "IGG"), groups=[16])
    assert plan.chosen.strategy.letters == "GGG" and plan.runner_up is None
    assert "only candidate that fits" in plan.reason() and "paro-igg (groups of 16)" in plan.reason()
    peak = plan.chosen.memory["peak"]
    with pytest.raises(PlanError, match=r"fits no strategy on 64 ranks with 8 GiB per device .* the smallest peak is "
                                        r"zero3's, 8.23 GiB per rank, which needs at least 9.14 GiB"):
        make_plan(job, cluster("perlmutter", 64, 4, 8, 312))
    assert peak / 0.9 / GIB == pytest.approx(9.14, abs=0.005)


def test_the_memory_objective_takes_the_smallest_peak():
    job = Job.for_global_batch(GPTConfig.preset("gpt_125m"), 16, 16 * 2048 * 2, 2048, 1, precision="bf16")
    roomy = cluster("perlmutter", 16, 4, 40, 312)
    plan = make_plan(job, roomy, objective="memory", strategies=("zero3", "zero2", "IIG"))
    peaks = [c.memory["peak"] for c in plan.ranked]
    assert plan.chosen.strategy.letters == "GGG" and peaks == sorted(peaks)
    assert "needs the least memory" in plan.reason()


def test_llama_8b_on_64_gpus_of_80_gb_by_hand(capsys):
    """shard-plan for Llama 3 8B on 8 nodes of 8 80 GB GPUs: ZeRO-3's parts against a hand
    count. psi = 8,030,261,248; per rank, the optimizer's fp32 master and moments, 12 psi / 64,
    and the fp32 gradient shard, 4 psi / 64. The activations of one micro-batch of 1 x 2048 in
    bf16 (2 bytes), per token and block: qkv's input, attention's output and up's input (3 x
    4096), q, k and v (32 + 2 x 8 heads of 128: 6144), SwiGLU's gate and up, silu's output and
    down's input (4 x 14336), the rotated q and k and proj's input (2 x 4096 + 8 x 128), in
    bf16; two RMSNorms that torch computes in fp32 (2 x (2 x 4096 + 1) x 4 bytes); and the
    attention's fp32 log-sum-exp per head (32 x 4). Then the head: the final norm and the
    loss's input gradient per token, and its weight's gradient (128256 x 4096 x 2), and the
    token ids (8 bytes) and the rotary tables (32 blocks x 2048 x 128 x 2 bytes)."""
    main(["--model", "llama_8b", "--world", "64", "--ranks-per-node", "8", "--memory", "80GB", "--json"])
    out = json.loads(capsys.readouterr().out)
    psi = 8_030_261_248
    zero3 = next(r for r in out["rows"] if r["name"] == "zero3")["memory"]
    assert zero3["optimizer"] == pytest.approx(12 * psi / 64, rel=1e-6)
    assert zero3["gradients"] == pytest.approx(4 * psi / 64, rel=1e-6)
    d, tokens = 4096, 2048
    block = (3 * d + 6144 + 4 * 14336 + 2 * d + 8 * 128) * 2 + 2 * (2 * d + 1) * 4 + 32 * 4
    head = tokens * ((2 * d + 1) * 4 + d * 2) + 128256 * d * 2
    assert zero3["activations"] == 32 * tokens * block + head + tokens * 8 + 32 * tokens * 128 * 2
    assert out["chosen"]["fits"]


def test_shard_plan_prints_json_with_chosen_and_rows(capsys):
    main(["--model", "gpt_125m", "--world", "16", "--ranks-per-node", "4", "--profile", "perlmutter", "--memory",
          "40GB", "--global-batch", str(16 * 2048 * 2), "--strategies", "zero3,zero2,IIG", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert {"chosen", "rows", "reason", "margin", "runner_up"} <= set(out)
    rows = out["rows"]
    assert out["chosen"] == rows[0] and [r["rank"] for r in rows] == [1, 2, 3, 4, 5]   # IIG at groups 2, 4, 8
    assert all(r["fits"] and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 0.35 for r in rows)
    assert rows == sorted(rows, key=lambda r: -r["tokens_per_s"])
    assert {r["group"] for r in rows if r["strategy"] == "IIG"} == {2, 4, 8}
    assert out["cluster"]["memory_bytes"] == 40 * GIB


def test_shard_plan_with_parameters_kept_counts_them_and_drops_the_backward_gathers(capsys):
    """--keep-parameters (reshard_after_forward=False): the gathered parameters grow to the
    whole model's in bf16 (the root and a unit's before), and the predicted communication
    falls (no gathers in the backward)."""
    rows = {}
    for keep in ([], ["--keep-parameters"]):
        main(["--model", "gpt_125m", "--world", "8", "--ranks-per-node", "8", "--profile", "dgx-h100",
              "--global-batch", str(8 * 2048 * 2), "--strategies", "zero3", "--json", *keep])
        rows[bool(keep)] = json.loads(capsys.readouterr().out)["chosen"]
    kept, default = rows[True], rows[False]
    params = GPTConfig.preset("gpt_125m").num_params()
    assert kept["memory"]["gathered"] >= 2 * params > 2 * default["memory"]["gathered"]   # bf16: 2 bytes each
    assert kept["memory"]["peak"] > default["memory"]["peak"] and kept["comm_s"] < default["comm_s"]


def test_shard_plan_refuses_bad_input(capsys):
    with pytest.raises(SystemExit, match="not a whole number of micro-batches"):
        main(["--world", "1000", "--profile", "frontier"])
    with pytest.raises(SystemExit, match="group size 3 must divide the world of 16 ranks"):
        main(["--model", "gpt_125m", "--world", "16", "--groups", "3", "--global-batch", "65536"])
    with pytest.raises(SystemExit, match="no device memory known for profile 'generic'"):
        main(["--model", "gpt_125m", "--world", "16", "--profile", "generic", "--global-batch", "65536"])


@pytest.fixture
def comm():
    return pccl.Communicator(MPI.COMM_SELF, timeout=60)


def test_engine_auto_trains_with_the_planners_choice(comm):
    cfg = GPTConfig(vocab=256, context=32, width=64, layers=2, heads=4)
    engine, plan = build_engine(GPT(cfg), comm, strategy="auto", workload=Workload(16, 2, 1))
    optimizer = ShardedAdamW(engine, lr=1e-2)
    try:
        assert engine.strategy == plan.chosen.strategy and isinstance(engine.strategy, Strategy)
        assert plan.cluster.shared_cores and plan.cluster.rate.flops_per_s > 0
        tokens = torch.randint(0, cfg.vocab, (2, 17), generator=torch.Generator().manual_seed(0))
        losses = []
        for _ in range(3):
            loss = next_token_loss(engine, tokens)
            engine.backward(loss)
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
    finally:
        engine.close()


def test_engine_auto_refuses_what_it_cannot_plan(comm):
    cfg = GPTConfig(vocab=256, context=32, width=64, layers=2, heads=4)
    with pytest.raises(PlanError, match="needs workload=Workload"):
        build_engine(GPT(cfg), comm, strategy="auto")
    with pytest.raises(PlanError, match="plans for the GPT of shard/models/gpt.py"):
        build_engine(torch.nn.Sequential(torch.nn.Linear(4, 4)), comm, strategy="auto", workload=Workload(4, 1, 1))
    with pytest.raises(ValueError, match="workload= is for strategy='auto'"):
        build_engine(GPT(cfg), comm, strategy="zero3", workload=Workload(16, 2, 1))
    with pytest.raises(ValueError, match="objective must be one of"):
        build_engine(GPT(cfg), comm, strategy="auto", workload=Workload(16, 2, 1), auto={"objective": "speed"})
    with pytest.raises(PlanError, match=r"give the engine a real device \(device=\)"):
        with torch.device("meta"):
            model = GPT(cfg)
        build_engine(model, comm, strategy="auto", workload=Workload(16, 2, 1))
    # the engine itself takes a named strategy, and says what plans one
    with pytest.raises(ValueError, match=r"strategy='auto' is the planner's choice.*shard.planning.build_engine"):
        Engine(GPT(cfg), comm, strategy="auto", workload=Workload(16, 2, 1))
    with pytest.raises(ValueError, match=r"strategy='auto' is the planner's choice.*shard.planning.build_engine"):
        Engine(GPT(cfg), comm, strategy="auto")


def test_build_engine_with_a_named_strategy_is_the_engine_and_no_plan(comm):
    cfg = GPTConfig(vocab=256, context=32, width=64, layers=2, heads=4)
    engine, plan = build_engine(GPT(cfg), comm, strategy="zero3", prefetch=2)
    try:
        assert plan is None and engine.strategy.name == "zero3" and engine.config.prefetch == 2
    finally:
        engine.close()


def test_a_global_batch_of_more_micro_batches_than_a_trace_replays_is_refused():
    """Each micro-batch of a step is traced: 1e12 tokens on 8 ranks would have been 488M of
    them, hours of tracing, before any answer."""
    cfg = GPTConfig.preset("gpt_7b")
    assert Job.for_global_batch(cfg, 8, 8 * 2048 * 4096, 2048, 1).micro_batches == 4096
    with pytest.raises(PlanError, match="is 4097 micro-batches a step per rank, more than the 4096"):
        Job.for_global_batch(cfg, 8, 8 * 2048 * 4097, 2048, 1)
