"""Multi-rank two-level plans on emulated nodes: p=8 as 2x4 and 4x2, p=6 as 2x3 and 3x2,
p=4 as 2x2, p=1; every collective, plan, dtype and op against the reference, over the C++
and Python MPI executors, gloo, and mixed transports (intra gloo, inter MPI); async plans.
One mpiexec launch per topology; each group is reported as its own test case."""
import pytest

from tests.pccl.workers.cases import AGREEING_PLANS, PLAN_TOPOLOGIES, PLAN_TRANSPORTS, REDUCING, group_id, plan_groups
from tests.support.mpirun import check_group as check
from tests.support.mpirun import report_of

pytestmark = pytest.mark.mpi

_reports: dict = {}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    def get(p: int, ranks_per_node: int) -> dict:
        return report_of(_reports, (p, ranks_per_node), tmp_path_factory.mktemp(f"plans{p}x{ranks_per_node}"),
                         p, "-m tests.pccl.workers.run_plans", str(ranks_per_node))
    return get


TOPOLOGY_IDS = [f"{p // r}x{r}" for p, r in PLAN_TOPOLOGIES]


@pytest.mark.parametrize("p,ranks_per_node", PLAN_TOPOLOGIES, ids=TOPOLOGY_IDS)
@pytest.mark.parametrize("transport,collective,spec", plan_groups(), ids=lambda v: str(v))
def test_plan(report, p, ranks_per_node, transport, collective, spec):
    check(report(p, ranks_per_node), group_id(transport, collective, spec))


@pytest.mark.parametrize("p,ranks_per_node", PLAN_TOPOLOGIES, ids=TOPOLOGY_IDS)
@pytest.mark.parametrize("transport", list(PLAN_TRANSPORTS))
def test_async_plans_keep_issue_order(report, p, ranks_per_node, transport):
    check(report(p, ranks_per_node), f"_async-{transport}")


@pytest.mark.parametrize("p,ranks_per_node", PLAN_TOPOLOGIES, ids=TOPOLOGY_IDS)
@pytest.mark.parametrize("collective,spec", [(c, s) for c in REDUCING for s in AGREEING_PLANS], ids=lambda v: str(v))
def test_transports_give_bit_identical_avg(report, p, ranks_per_node, collective, spec):
    """The same plan, pccl schedules on every level, over the C++ and Python MPI executors,
    gloo and mixed levels: op avg of random values, the same bits on each."""
    check(report(p, ranks_per_node), f"_agree-{collective}-{spec}")
