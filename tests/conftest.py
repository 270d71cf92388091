"""The whole suite's environment: the product as it ships, every default on (a test that
needs a fixed choice sets it itself and says why), from an empty calibration cache, as on a
fresh machine. Where the cache lives is not a choice the product makes for its users:
the suite's own keeps the runs of developers' tests out of their ~/.cache/pccl (and theirs
out of the suite), and the suite's first calls of each world shape measure it, as a new
user's do."""
import atexit
import os
import shutil
import tempfile

import pytest

os.environ["PCCL_CACHE_DIR"] = tempfile.mkdtemp(prefix="pccl-test-cache-")
atexit.register(shutil.rmtree, os.environ["PCCL_CACHE_DIR"], ignore_errors=True)

# make test runs the multi-rank files two at a time (--dist loadfile: a file's tests on the
# worker that takes it). The files whose launches take longest start first, so that the two
# workers finish about together instead of one running the last long file alone; the others
# keep their order (serially, in minutes: train 4.3, backend 2.9, plans 2.8, faults 2.6,
# collectives 2.5, special 2.3, engine 1.9, the rest 1.4 or less).
LONGEST_FIRST = ("tests/shard/test_train_mpi.py", "tests/pccl/test_backend.py", "tests/pccl/test_plans_mpi.py",
                 "tests/faults/test_faults.py", "tests/pccl/test_collectives_mpi.py", "tests/pccl/test_special_mpi.py",
                 "tests/shard/test_engine_mpi.py")


def pytest_collection_modifyitems(items):
    first = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))   # stable: files stay whole


# The fault-injection suite's table (tests/faults), printed after the run. Here, not in
# tests/faults/conftest.py: under pytest-xdist (make test runs the multi-rank tests two files
# at a time) the controller prints the summary without collecting tests/faults, and a worker
# hands it the rows it ran.
_FAULT_ROWS = "fault_rows"
_rows_from_workers: list[str] = []


def _fault_rows() -> list[str]:
    import sys

    suite = sys.modules.get("tests.faults.test_faults")
    return [outcome.row() for outcome in suite.ROWS] if suite else []


def pytest_sessionfinish(session):
    output = getattr(session.config, "workeroutput", None)
    if output is not None:   # an xdist worker: the controller prints
        output[_FAULT_ROWS] = _fault_rows()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _rows_from_workers.extend(getattr(node, "workeroutput", {}).get(_FAULT_ROWS, []))


def pytest_terminal_summary(terminalreporter):
    from tests.faults.suite import TABLE_HEAD

    rows = _fault_rows() + _rows_from_workers
    if rows:
        terminalreporter.write_sep("=", "fault-injection suite: fault x place x executor -> outcome")
        terminalreporter.write_line(TABLE_HEAD)
        for row in rows:
            terminalreporter.write_line(row)
