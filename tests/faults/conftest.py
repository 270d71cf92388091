"""Prints the fault-injection suite's table (tests/faults/test_faults.py) after the run."""
from tests.faults.suite import TABLE_HEAD


def pytest_terminal_summary(terminalreporter):
    from tests.faults.test_faults import ROWS

    if ROWS:
        terminalreporter.write_sep("=", "fault-injection suite: fault x place x executor -> outcome")
        terminalreporter.write_line(TABLE_HEAD)
        for outcome in ROWS:
            terminalreporter.write_line(outcome.row())
