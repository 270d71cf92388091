"""Multi-rank correctness: every executor x collective x algorithm on p in {1,...,8} ranks.

Each world size is one mpiexec launch (tests/mpi/run_collectives.py) that runs the whole
matrix and writes a report; each (p, executor, collective, algorithm) group is reported
here as its own test case.
"""
import json

import pytest

from tests.launch import mpiexec
from tests.mpi.cases import EXECUTORS, WORLD_SIZES, group_id, groups

_reports: dict[int, dict] = {}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    def get(p: int) -> dict:
        if p not in _reports:
            path = tmp_path_factory.mktemp(f"p{p}") / "report.json"
            run = mpiexec(p, "tests/mpi/run_collectives.py", str(path))
            if run.returncode != 0 or not path.exists():
                _reports[p] = {"_launch": f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"}
            else:
                _reports[p] = json.loads(path.read_text())
        return _reports[p]
    return get


def check(report: dict, key: str) -> None:
    assert "_launch" not in report, report.get("_launch")
    assert key in report, f"no result for {key}"
    assert report[key] == [], "\n".join(report[key][:20])


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("executor,collective,algorithm", groups(), ids=lambda v: str(v))
def test_collective(report, p, executor, collective, algorithm):
    check(report(p), group_id(executor, collective, algorithm))


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("executor", EXECUTORS)
def test_bad_input_raises_and_leaves_communicator_usable(report, p, executor):
    check(report(p), f"_bad_input-{executor}")
