"""Bad flags of every command-line tool (pccl-bench, pccl-sim, pccl-call-cost, shard-compare, shard-sim,
shard-plan, the convergence benchmark), table-driven:
each is refused by the argument parser, before any MPI job, measurement or launch, with
a message naming the flag and what was expected."""
from __future__ import annotations

import pytest

from pccl.tools import bench, call_cost, sim
from shard.tools import compare, convergence, step_sim, strategy_plan

TOOLS = {"pccl-bench": bench.parse_args, "pccl-sim": sim.parse_args,
         "pccl-call-cost": call_cost.main, "shard-compare": compare.parse,
         "shard-sim": step_sim.parse, "shard-plan": strategy_plan.parse, "convergence": convergence.parse}
CASES = [
    ("pccl-bench", ["-b", "12Q"], "size must be"),
    ("pccl-bench", ["-b", "0", "-e", "4K"], "expected a size of at least 1 byte, got '0'"),   # it hung
    ("pccl-bench", ["--calibrate", "/dev/null/x.json"], "/dev/null is not a directory"),   # after the measuring
    ("pccl-bench", ["--calibrate", "/tmp"], "is a directory; name the file to write"),
    ("pccl-bench", ["--ranks-per-node", "3"], "--ranks-per-node 3 does not divide the 1 ranks"),
    ("pccl-bench", ["-b", "4M", "-e", "1M"], "--minbytes (4194304) must not exceed --maxbytes"),
    ("pccl-bench", ["-f", "1"], "expected an integer >= 2, got 1"),
    ("pccl-bench", ["-n", "0"], "expected an integer >= 1, got 0"),
    ("pccl-bench", ["-n", "x"], "expected an integer >= 1, got 'x'"),
    ("pccl-bench", ["-w", "-1"], "expected an integer >= 0, got -1"),
    ("pccl-bench", ["--repeats", "0"], "expected an integer >= 1"),
    ("pccl-bench", ["--ranks-per-node", "0"], "expected an integer >= 1"),
    ("pccl-bench", ["-c", "2"], "invalid choice"),
    ("pccl-bench", ["-d", "complex"], "invalid choice"),
    ("pccl-bench", ["-d", "int32", "-o", "avg"], "op avg needs a floating-point datatype"),
    ("pccl-bench", ["--collectives", "broadcast"], "broadcast"),
    ("pccl-bench", ["--algorithms", "rign"], "rign"),
    ("pccl-bench", ["--executors", "fortran"], "fortran"),
    ("pccl-bench", ["--compression", "int7"], "int7"),
    ("pccl-bench", ["--intra", "smoke"], "invalid choice"),
    ("pccl-bench", ["--device", "tpu"], "invalid choice"),
    ("pccl-bench", ["--device", "cuda", "--calibrate", "p.json"], "--calibrate measures host buffers"),
    ("pccl-call-cost", ["--bytes", "7"], "--bytes must be a multiple of 4 (float32 elements), got 7"),
    ("pccl-sim", ["--profile", "nowhere"], "no profile 'nowhere'"),
    ("pccl-sim", ["--size", "0"], "--size must be positive"),
    ("pccl-sim", ["--ranks", "0"], "--ranks must be positive"),
    ("pccl-sim", ["--ranks", "x"], "--ranks x: invalid literal"),   # (it named no flag)
    ("pccl-sim", ["--ranks-per-node", "0"], "expected an integer >= 1"),
    ("pccl-sim", ["--nics-per-node", "-2"], "expected an integer >= 1"),
    ("pccl-sim", ["--collective", "gossip"], "invalid choice"),
    ("pccl-sim", ["--target", "nosuch"], "invalid choice: 'nosuch'"),   # (checked only with --heatmap)
    ("pccl-sim", ["--baseline", "nosuch"], "invalid choice: 'nosuch'"),
    ("pccl-sim", ["--compression", "int7"], "int7"),
    ("shard-compare", ["--ranks", "0"], "expected an integer >= 1, got 0"),
    ("shard-compare", ["--ranks-per-node", "x"], "expected an integer >= 1, got 'x'"),
    ("shard-compare", ["--nodes", "2x0"], "nodes and ranks per node must be >= 1"),
    ("shard-compare", ["--nodes", "two"], "expected NxM"),
    ("shard-compare", ["--steps", "1"], "expected an integer >= 2, got 1"),
    ("shard-compare", ["--steps", "4", "--warmup", "4"], "--warmup (4) must leave timed steps"),
    ("shard-compare", ["--batch", "0"], "expected an integer >= 1"),
    ("shard-compare", ["--micro", "-1"], "expected an integer >= 1"),
    ("shard-compare", ["--seq", "0"], "expected an integer >= 1"),
    ("shard-compare", ["--launches", "0"], "expected an integer >= 1"),
    ("shard-compare", ["--width", "0"], "expected an integer >= 1"),
    ("shard-compare", ["--runs", ","], "expected one name or more, comma-separated, got ','"),   # (an empty table)
    ("shard-compare", ["--rate", "1mbit"], "--rate 1mbit shapes emulated nodes' links: give --nodes too"),
    ("shard-compare", ["--out", "/dev/null"], "/dev/null is a file, not a directory"),   # (after the launches)
    ("shard-sim", ["--strategies", ","], "expected one name or more"),
    ("shard-sim", ["--comms", ""], "expected one name or more"),
    ("shard-sim", ["--json", "/tmp"], "/tmp is a directory; name the file to write"),   # (after the rows)
    ("shard-plan", ["--world", "8", "--strategies", ","], "expected one name or more"),   # (min() of nothing)
    ("pccl-bench", ["--json", "/nonexistent/x.json"], "is in /nonexistent, which does not exist"),
    ("pccl-bench", ["-b", "1", "-e", "2"], "no size from --minbytes 1 to --maxbytes 2 splits into 1 blocks"),
    ("shard-sim", ["--micro-batch", "0"], "expected an integer >= 1, got 0"),
    ("shard-sim", ["--ranks-per-node", "-1"], "expected an integer >= 1, got -1"),
    ("shard-sim", ["--prefetch", "-1"], "expected an integer >= 0, got -1"),
    ("shard-sim", ["--mfu", "0"], "expected a number above 0 and at most 1, got '0'"),
    ("shard-sim", ["--mfu", "1.5"], "expected a number above 0 and at most 1, got '1.5'"),
    ("shard-sim", ["--global-batch", "1e12"], "expected an integer >= 1, got '1e12'"),
    ("shard-plan", ["--world", "8", "--global-batch", "inf"], "expected an integer >= 1, got 'inf'"),
    ("shard-plan", ["--world", "8", "--global-batch", "4194304.5"], "expected an integer >= 1"),
    ("shard-plan", ["--world", "8", "--mfu", "1.5"], "expected a number above 0 and at most 1"),
    ("shard-plan", ["--world", "8", "--headroom", "1"], "expected a number from 0 to 0.9"),
    ("convergence", ["--ranks", "0"], "expected an integer >= 1, got 0"),   # it launched mpiexec -n 0
    ("convergence", ["--steps", "0"], "expected an integer >= 1, got 0"),
    ("convergence", ["--ranks", "3"], "--ranks-per-node (2) must divide --ranks (3)"),
    ("convergence", ["--tolerance", "-1"], "expected a number from 0 to 1"),
    ("convergence", ["--strategies", "zero3+int7"], "--strategies: zero3+int7:"),
]


@pytest.mark.parametrize("argv,message", [
    (["--ranks", "0"], "--ranks: expected positive world sizes"),
    (["--ranks", "8:2"], "--ranks: expected positive world sizes"),
    (["--ranks", "12", "--ranks-per-node", "8"], "world size 12 is not divisible by ranks_per_node=8"),
    (["--strategies", "foo"], "--strategies: unknown strategy 'foo'"),
    (["--profile", "nope"], "no profile 'nope'"),
])
def test_shard_sim_refuses_what_it_cannot_simulate_before_any_row(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        step_sim.main(["--model", "gpt_7b", "--comms", "native", *argv])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and message in err and out == "", err


@pytest.mark.parametrize("tool,argv,message", CASES, ids=[f"{t} {' '.join(a)}" for t, a, _ in CASES])
def test_bad_flags_are_refused_before_anything_runs(tool, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        TOOLS[tool](argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_every_numeric_flag_is_in_the_table():
    """Each tool's int-typed flags have a bound (at_least), so none takes a negative or zero
    count silently."""
    import argparse

    for tool, parse in TOOLS.items():
        parser = None

        def capture(self, *a, **k):
            nonlocal parser
            parser = self
            raise SystemExit(0)
        original = argparse.ArgumentParser.parse_args
        argparse.ArgumentParser.parse_args = capture
        try:
            with pytest.raises(SystemExit):
                parse([])
        finally:
            argparse.ArgumentParser.parse_args = original
        unbounded = [a.option_strings for a in parser._actions if a.type is int and a.choices is None]
        assert unbounded == [], f"{tool}: int flags without a bound: {unbounded}"


# Bad input found after parsing, but before anything runs: every command says it in one line
# and exits with status 2, as the parser's errors do (shard-train's own test is in
# tests/shard/test_preflight.py).
LATE = [
    (["shard-compare", "--runs", "eager,nonsense"], "shard-compare: unknown run 'nonsense'"),
    (["shard-sim", "--model", "gpt_9000"], "shard-sim: --model: unknown model preset 'gpt_9000'"),
    (["shard-plan", "--model", "gpt_125m", "--world", "16", "--groups", "3", "--global-batch", "65536"],
     "shard-plan: group size 3 must divide"),
    (["pccl-sim", "--ranks", "6", "--ranks-per-node", "4"], "pccl-sim: "),
]


@pytest.mark.parametrize("argv,line", LATE, ids=[a[0] for a, _ in LATE])
def test_bad_input_is_one_line_and_exit_status_2(argv, line, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    command = Path(sys.executable).parent / argv[0]
    run = subprocess.run([str(command), *argv[1:]], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith(line) and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
