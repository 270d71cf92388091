"""shard-train's profiler (shard/tools/profiling.py): which steps it traces, what it writes,
and what it tells; the engine's lanes see it recording (their spans on several ranks are
held in tests/shard/test_train_mpi.py)."""
import gzip
import json

import pytest
import torch

from shard.engine.lanes import profiling
from shard.tools.profiling import StepProfiler

CPU = torch.device("cpu")


def run(tmp_path, first, steps, done, last_step, fail_at=None):
    """Steps done+1..last_step of a stand-in workload under a StepProfiler; what it said,
    which steps it said it slows, and whether torch.profiler recorded during each step."""
    said = []
    profiler = StepProfiler(first, steps, done, last_step, tmp_path / "profile", 3, CPU, said.append)
    recording, slowed = {}, []
    try:
        for step in range(done + 1, last_step + 1):
            with profiler.step(step):
                recording[step] = profiling()
                torch.ones(64, 64).matmul(torch.ones(64, 64))
                if step == fail_at:
                    raise RuntimeError("a step fails")
            slowed += [step] if profiler.slows(step) else []
    finally:
        profiler.close()
    return said, slowed, recording


def spans(path):
    events = json.load(gzip.open(path))["traceEvents"]
    return sorted(e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("step "))


def test_the_window_is_traced_after_a_warm_up_step_and_written_once_it_closes(tmp_path):
    said, slowed, recording = run(tmp_path, first=3, steps=2, done=0, last_step=6)
    where = tmp_path / "profile" / "steps3-4"
    assert sorted(p.name for p in where.iterdir()) == ["rank3.json.gz", "rank3.txt"]   # no partial file left
    assert spans(where / "rank3.json.gz") == ["step 3", "step 4"]   # the warm-up step 2 is not in the trace
    assert "aten::mm" in (where / "rank3.txt").read_text()
    assert recording == {1: False, 2: False, 3: True, 4: True, 5: False, 6: False}
    assert slowed == [2, 3, 4]   # the warm-up step runs under the profiler too
    assert said == [f"profile of steps 3-4: {where}/rank*.json.gz (every rank's trace: ui.perfetto.dev or "
                    "chrome://tracing) and rank*.txt (the operators that took the most time)"]


def test_a_window_at_the_sessions_first_step_has_no_warm_up_and_one_past_the_end_is_cut_there(tmp_path):
    said, slowed, recording = run(tmp_path, first=5, steps=10, done=4, last_step=7)
    assert spans(tmp_path / "profile" / "steps5-7" / "rank3.json.gz") == ["step 5", "step 6", "step 7"]
    assert slowed == [5, 6, 7] and all(recording.values())


def test_a_session_resumed_inside_the_window_traces_the_rest_of_it(tmp_path):
    said, slowed, recording = run(tmp_path, first=4, steps=3, done=4, last_step=8)
    assert spans(tmp_path / "profile" / "steps5-6" / "rank3.json.gz") == ["step 5", "step 6"]
    assert slowed == [5, 6] and said[0].startswith("profile of steps 5-6: ")


def test_a_window_outside_the_session_traces_nothing_and_says_so(tmp_path):
    said, slowed, recording = run(tmp_path, first=3, steps=2, done=10, last_step=12)
    assert said == ["log.profile: steps 3-4 lie outside this session's steps 11-12: nothing is traced"]
    assert slowed == [] and not any(recording.values()) and not (tmp_path / "profile").exists()


def test_a_run_that_fails_inside_the_window_keeps_what_was_traced(tmp_path):
    with pytest.raises(RuntimeError, match="a step fails"):
        run(tmp_path, first=2, steps=3, done=0, last_step=6, fail_at=3)
    assert spans(tmp_path / "profile" / "steps2-3" / "rank3.json.gz") == ["step 2", "step 3"]


def test_bad_settings_name_their_key():
    from shard.tools.settings import ConfigError, Profile

    with pytest.raises(ConfigError, match=r"log.profile.steps must be an integer >= 0, got -1"):
        Profile.of({"steps": -1, "start": 10}, "log.profile")
    with pytest.raises(ConfigError, match=r"log.profile.start must be an integer >= 1, got 0"):
        Profile.of({"steps": 1, "start": 0}, "log.profile")


@pytest.mark.parametrize("fail_at", [None, 3])
def test_a_trace_that_cannot_be_written_is_reported_and_the_training_goes_on(tmp_path, capsys, fail_at):
    """out_dir/profile is a file (as a full disk or a bad directory would refuse it): the
    steps all run, stderr says why there is no trace, and a step's own failure is what a
    failing run raises."""
    (tmp_path / "profile").write_text("not a directory")
    if fail_at is None:
        said, slowed, recording = run(tmp_path, first=2, steps=2, done=0, last_step=5)
        assert list(recording) == [1, 2, 3, 4, 5] and said == []
    else:
        with pytest.raises(RuntimeError, match="a step fails"):
            run(tmp_path, first=2, steps=3, done=0, last_step=5, fail_at=fail_at)
    assert "shard-train: rank 3: log.profile: could not write the trace of steps 2-3 to " in capsys.readouterr().err
    assert (tmp_path / "profile").read_text() == "not a directory"
