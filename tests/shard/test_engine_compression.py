"""The engine with compressed parameter gathers and gradient reductions (ZeRO++'s qwZ and
qgZ on pccl's collective-level codecs), against the same run uncompressed, on 4 ranks as 2
groups of 2 (tests/shard/workers/run_compressed_engine.py)."""
import pytest

from tests.support.mpirun import report_of

pytestmark = pytest.mark.mpi
LR = 3e-3   # tests.shard.reference.HYPER


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    result = report_of({}, "compressed", tmp_path_factory.mktemp("c"), 4,
                       "-m tests.shard.workers.run_compressed_engine")
    assert "_launch" not in result, result.get("_launch")
    return result


@pytest.mark.parametrize("strategy", ["zero3", "paro-iig"])
def test_compressed_training_stays_near_the_exact_run_and_sends_less(report, strategy):
    exact = report[f"{strategy}/exact"]
    assert exact["max_param_diff"] == 0.0
    for name in ("int8", "bf16-grads", "zfp16-params"):
        run = report[f"{strategy}/{name}"]
        for a, b in zip(run["losses"], exact["losses"]):
            assert abs(a - b) <= 0.01 * abs(b), (name, run["losses"], exact["losses"])   # 1% of the loss
        # the master weights stay exact: parameters move apart only through the compressed
        # gradients' effect on 3 AdamW steps (each at most a few lr per element)
        assert 0 < run["max_param_diff"] <= 3 * 3 * LR, (name, run["max_param_diff"])
        assert run["sent"] < exact["sent"], name
    # int8 parameters and gradients: every byte of the engine's traffic is int8 (plus a
    # 4-byte scale per 128 values) instead of fp32
    assert report[f"{strategy}/int8"]["sent"] <= exact["sent"] / 3.5


def test_bad_compression_settings_raise_clearly(report):
    errors = report["_errors"]
    assert "unknown codec 'int4'" in errors["unknown codec"]
    assert "would not make torch.bfloat16 data smaller" in errors["bf16 of bf16 parameters"]
