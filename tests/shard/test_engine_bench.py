"""shard-bench's table: the hidden and overlap shares against hand-computed rows, the
table's lines, the launches it plans, its progress, and its refusals of bad input. Nothing
here launches mpiexec; one test runs the worker in this process (a world of one rank)."""
import io
import json
import sys

import pytest

from shard.tools import engine_bench as eb

# compute only: median 1.0 s, median absolute deviation 0.
COMPUTE = {"strategy": "none", "prefetch": None, "ranks": 4, "step_s": 1.0, "step_times_s": [1.0, 1.1, 0.9, 1.0, 1.0],
           "state_bytes": 8_000_000, "peak_rss_mb": 400.0}


def row(step_times, replays=(0.5, 0.5, 0.5), exposed=0.3, other=0.0, busy=(0.4, 0.6), **extra):
    times = sorted(step_times)
    return {"strategy": "zero3", "prefetch": 1, "ranks": 4, "step_s": times[len(times) // 2],
            "step_times_s": list(step_times), "comm_alone_s": sorted(replays)[1], "replays_s": list(replays),
            "exposed_s": exposed, "other_waits_s": other, "busy_s": {"gather": busy[0], "reduce": busy[1]},
            "sent_bytes": 16_680_000, "state_bytes": 5_290_000, "peak_rss_mb": 399.4, **extra}


# step median 1.2 s, deviations 0.1, 0, 0.1, 0, 0.05: median absolute deviation 0.05 s.
SPREAD = [1.1, 1.2, 1.3, 1.2, 1.25]


def test_the_median_absolute_deviation():
    assert eb.mad([1.1, 1.2, 1.3, 1.2, 1.25]) == pytest.approx(0.05)
    assert eb.mad([3.0, 1.0]) == pytest.approx(1.0)
    assert eb.mad([2.0, 2.0, 100.0]) == 0.0   # one outlier does not count


def test_hidden_is_the_share_of_communication_alone_that_did_not_lengthen_the_step():
    # step - compute = 0.2 of 0.5 s alone: 60% hidden; noise 0.05 + 0 + 0 over 0.5 s: ±10 points
    share, uncertainty, why = eb.hidden_share(row(SPREAD), COMPUTE, cores=8)
    assert (share, uncertainty, why) == (pytest.approx(0.6), pytest.approx(0.1), "")


def test_hidden_is_not_measured_on_shared_cores():
    # 4 ranks need 8 cores: compute-only and the replay each had a core per rank
    assert eb.hidden_share(row(SPREAD), COMPUTE, cores=7) == (None, None, "cores shared")


def test_hidden_is_not_measured_without_communication():
    # one rank, or a world of single-rank scopes: the replay times nothing
    assert eb.hidden_share(row(SPREAD, replays=(1e-6, 1e-6, 1e-6), sent_bytes=0), COMPUTE, cores=8) == \
        (None, None, "nothing sent")


def test_hidden_is_not_measured_when_the_noise_is_half_of_communication_alone():
    # noise 0.05 + 0.02 (the replays: 0.10, 0.12, 0.14) = 0.07 s; alone 0.12 s < 2 x 0.07
    assert eb.hidden_share(row(SPREAD, replays=(0.10, 0.12, 0.14)), COMPUTE, cores=16) == \
        (None, None, "noise 70.0 ms, alone 120.0 ms")


def test_hidden_outside_0_100_by_more_than_the_noise_is_not_measured():
    # step 0.9 s: 0.1 s under compute, the noise 0.05 s
    assert eb.hidden_share(row([0.8, 0.9, 1.0, 0.9, 0.95]), COMPUTE, cores=8)[2] == "step < compute"
    # step 1.6 s: 0.6 s over compute, more than 0.5 s alone + 0.05 s noise
    assert eb.hidden_share(row([1.5, 1.6, 1.7, 1.6, 1.65]), COMPUTE, cores=8)[2] == "step > compute + alone"


def test_hidden_within_the_noise_of_a_bound_is_that_bound():
    # step 0.97 s: 0.03 s under compute, within the 0.05 s noise: 100%
    assert eb.hidden_share(row([0.87, 0.97, 1.07, 0.97, 1.02]), COMPUTE, cores=8)[:2] == \
        (1.0, pytest.approx(0.1))
    # step 1.53 s: 0.53 s over compute, 0.03 s more than alone: 0%
    assert eb.hidden_share(row([1.43, 1.53, 1.63, 1.53, 1.58]), COMPUTE, cores=8)[:2] == \
        (0.0, pytest.approx(0.1))


def test_overlap_is_the_share_of_lane_work_the_loop_did_not_wait_for():
    # waited 0.2 + 0.1 of 0.4 + 0.6 s busy: 70%
    assert eb.overlap_share(row(SPREAD, exposed=0.2, other=0.1)) == (pytest.approx(0.7), "")
    # waited 1.05 s of 1.0 s busy: the extra is the lane threads' wake-ups, no share
    assert eb.overlap_share(row(SPREAD, exposed=1.0, other=0.05)) == (None, "waited > busy by 50.0 ms")
    assert eb.overlap_share(row(SPREAD, busy=(0.0, 0.0))) == (None, "no lane work")


def test_each_line_lies_under_its_header():
    lines = [eb.COLUMNS, eb.format_row(COMPUTE, None, cores=8), eb.format_row(row(SPREAD), COMPUTE, cores=8),
             eb.format_row(row([1.5, 1.6, 1.7, 1.6, 1.65], exposed=1.0, other=0.05, prefetch=None, strategy="ddp"),
                           COMPUTE, cores=2)]
    assert lines == [
        "strategy   pf   step s  +comm s  alone s   hidden   busy s waited s overlap  sent MB state MB  peak MB  note",
        "none        -    1.000        -        -        -        -        -       -        -     8.00      400"
        "  compute only",
        "zero3       1    1.200    0.200    0.500   60%±10    1.000    0.300     70%    16.68     5.29      399",
        "ddp         -    1.600    0.600    0.500      n/a    1.000    1.050     n/a    16.68     5.29      399"
        "  hidden: cores shared; overlap: waited > busy by 50.0 ms",
    ]


def test_strategies_that_gather_parameters_run_once_per_prefetch_value():
    args = eb.parse(["--strategies", "ddp,zero3,paro-nig,IIG"])
    assert eb.configurations(args) == [("none", None), ("ddp", None), ("zero3", 0), ("zero3", 1),
                                       ("paro-nig", None), ("paro-iig", 0), ("paro-iig", 1)]
    args = eb.parse(["--strategies", "zero1,mics", "--prefetch", "2"])
    assert eb.configurations(args) == [("none", None), ("zero1", None), ("mics", 2)]


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "4", "--group", "3"],
     "--ranks 4 is not divisible by --group 3; expected a group size among [1, 2, 4]"),
    (["--strategies", "zero3,bogus"], "unknown strategy 'bogus'"),
    (["--strategies", "zero3,GGG"], "names a strategy twice"),
    (["--strategies", "none,zero3"], "'none' is the compute-only launch"),
    (["--prefetch", "0,one"], "--prefetch must be integers"),
    (["--prefetch", "1,1"], "distinct and at least 0"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--width", "129"], "width 129 must be divisible by heads 2 (the model has width // 64 heads"),
    (["--strategy", "zero3", "--prefetch", "0,1"], "one --prefetch value per worker"),
    (["--strategy", "foo"], "unknown strategy 'foo'"),   # (a traceback on every rank, after MPI started)
    (["--strategy", "zero3", "--strategies", "zero1", "--json", "x.json"],   # (ignored, exit 0)
     "--strategies, --json: driver-mode options; --strategy runs one worker"),
    (["--algorithm", "bogus"], "unknown algorithm 'bogus'"),   # (it failed after the compute-only launch)
    (["--algorithm", "bruck"], "bruck"),   # an all-gather alone: the engine reduce-scatters too
])
def test_bad_input_is_refused_before_anything_launches(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        eb.parse(argv)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_progress_counts_launches_and_estimates_what_is_left(monkeypatch):
    clock = iter([100.0, 100.0, 130.0, 190.0])   # start, then each launch's beginning
    monkeypatch.setattr(eb.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    progress = eb.Progress(4, out)
    for what in ("none", "ddp", "zero3 prefetch 0"):
        progress.next(what)
    # after 1 launch in 30 s, 3 to come: 90 s; after 2 in 90 s, 2 to come: 90 s
    assert out.getvalue().splitlines() == [
        "[1/4] none: 0s elapsed, estimate after the first launch",
        "[2/4] ddp: 30s elapsed, about 1m30s left",
        "[3/4] zero3 prefetch 0: 1m30s elapsed, about 1m30s left",
    ]


def test_the_header_comes_first_and_each_row_as_its_launch_ends(monkeypatch, tmp_path):
    canned = {("none", None): COMPUTE, ("ddp", None): row(SPREAD, prefetch=None, strategy="ddp"),
              ("zero3", 0): row(SPREAD, prefetch=0), ("zero3", 1): row(SPREAD)}
    out = io.StringIO()
    launched = []

    def launch(args, strategy, prefetch):
        launched.append(out.getvalue().splitlines()[-1])   # what was printed before this launch
        return dict(canned[strategy, prefetch])

    monkeypatch.setattr(eb, "launch", launch)
    monkeypatch.setattr(eb, "available_cores", lambda: 8)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", out)
    eb.main(["--strategies", "ddp,zero3", "--json", str(tmp_path / "rows.json")])
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("shard-bench: 4 launches of 4 ranks in groups of 2")
    assert lines[1] == eb.COLUMNS
    assert launched[0].startswith("[1/4] none: ") and launched[1].startswith("[2/4] ddp: ")
    assert [line.split()[:2] for line in lines[2:-1]] == [
        ["[1/4]", "none:"], ["none", "-"], ["[2/4]", "ddp:"], ["ddp", "-"],
        ["[3/4]", "zero3"], ["zero3", "0"], ["[4/4]", "zero3"], ["zero3", "1"]]
    assert lines[-1].startswith("done in ")
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert saved["compute"]["step_s"] == 1.0 and saved["cores"] == 8
    assert [(r["strategy"], r["prefetch"], r["hidden"], r["overlap"]) for r in saved["rows"]] == [
        (name, pf, pytest.approx(0.6), pytest.approx(0.7)) for name, pf in (("ddp", None), ("zero3", 0), ("zero3", 1))]


def test_on_too_few_cores_the_run_says_why_hidden_is_not_measured(monkeypatch):
    monkeypatch.setattr(eb, "launch", lambda args, strategy, prefetch: dict(COMPUTE if strategy == "none" else
                                                                            row(SPREAD, prefetch=None, strategy="ddp")))
    monkeypatch.setattr(eb, "available_cores", lambda: 2)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    eb.main(["--strategies", "ddp"])
    assert "hidden: cores shared" in out.getvalue().splitlines()[-1]
    assert out.getvalue().splitlines()[1] == ("hidden: n/a on this machine: 4 ranks need 8 cores (compute and "
                                              "communication each on its own, as they were measured apart), 2 here")


@pytest.mark.parametrize("strategy", ["none", "zero3"])
def test_the_worker_reports_what_the_table_reads(strategy):
    args = eb.parse(["--strategy", strategy, "--group", "1", "--prefetch", "1", "--width", "32", "--layers", "1",
                     "--vocab", "64", "--context", "8", "--batch", "1", "--micro", "1", "--steps", "3",
                     "--warmup", "1"])
    got = eb.worker(args)
    assert len(got["step_times_s"]) == 3 and got["step_s"] == sorted(got["step_times_s"])[1]
    assert len(got["replays_s"]) == eb.REPLAYS and got["comm_alone_s"] == sorted(got["replays_s"])[1]
    assert set(got["busy_s"]) == {"gather", "reduce"} and got["exposed_s"] >= 0 and got["other_waits_s"] >= 0
    assert got["ranks"] == 1 and got["state_bytes"] > 0 and got["peak_rss_mb"] > 0
    eb.format_row(dict(got, prefetch=None if strategy == "none" else 1), None if strategy == "none" else got, cores=2)


def test_several_launches_report_the_median_one():
    launches = [{"step_s": 3.0, "n": 0}, {"step_s": 1.0, "n": 1}, {"step_s": 2.0, "n": 2}]
    assert eb.median_row(launches)["n"] == 2


def test_durations_read_as_minutes_and_seconds():
    assert [eb.duration(t) for t in (0.4, 59.4, 59.6, 119.7, 3599.5)] == ["0s", "59s", "1m00s", "2m00s", "60m00s"]
