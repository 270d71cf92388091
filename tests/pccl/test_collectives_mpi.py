"""Multi-rank correctness: every executor x collective x algorithm on p in {1,...,8} ranks.

Each world size is one mpiexec launch (-m tests.pccl.workers.run_collectives) that runs the whole
matrix and writes a report; each (p, executor, collective, algorithm) group is reported
here as its own test case.
"""
import pytest

from pccl.algorithms import algorithms_for
from tests.pccl.workers.cases import EXECUTORS, REDUCING, WORLD_SIZES, group_id, groups
from tests.support.mpirun import check_group as check
from tests.support.mpirun import report_of

pytestmark = pytest.mark.mpi

_reports: dict[int, dict] = {}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    def get(p: int) -> dict:
        return report_of(_reports, p, tmp_path_factory.mktemp(f"p{p}"), p, "-m tests.pccl.workers.run_collectives")
    return get


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("executor,collective,algorithm", groups(), ids=lambda v: str(v))
def test_collective(report, p, executor, collective, algorithm):
    check(report(p), group_id(executor, collective, algorithm))


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("executor", EXECUTORS)
def test_bad_input_raises_and_leaves_communicator_usable(report, p, executor):
    check(report(p), f"_bad_input-{executor}")


@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("collective,algorithm", [(c, a) for c in REDUCING for a in algorithms_for(c)],
                         ids=lambda v: str(v))
def test_executors_give_bit_identical_avg(report, p, collective, algorithm):
    """The C++ and Python executors over MPI and the torch.distributed executor (gloo), one
    schedule: op avg of random fp32, fp64, fp16 and bf16 values, the same bits on each."""
    check(report(p), f"_agree-{collective}-{algorithm}")
