"""Launch an mpiexec job from pytest and return its output (multi-rank tests)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from runkit.mpirun import MPIEXEC, launcher  # noqa: F401 - MPIEXEC is used by tests

ROOT = Path(__file__).resolve().parents[2]


def job_env() -> dict:
    """This environment without a surrounding MPI job's variables (pytest may itself run
    under mpiexec), one compute thread per rank."""
    prefixes = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "OMPI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    return dict(env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def mpiexec(ranks: int, script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `script` (a path under the repository, or "-m module") on `ranks` ranks. Past
    `timeout` seconds the whole job (mpiexec and every rank: its own session) is killed and
    subprocess.TimeoutExpired raised."""
    target = list(script.split()) if script.startswith("-m ") else [str(ROOT / script)]
    cmd = [*launcher(), "-n", str(ranks), sys.executable, *target, *args]
    with subprocess.Popen(cmd, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          start_new_session=True) as job:
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
            raise
    return subprocess.CompletedProcess(cmd, job.returncode, out, err)


def report_of(cache: dict, key, tmp_dir: Path, ranks: int, script: str, *args: str) -> dict:
    """The JSON report a worker writes (launched once per key and cached); on a failed
    launch, {"_launch": its output}."""
    if key not in cache:
        path = tmp_dir / "report.json"
        try:
            run = mpiexec(ranks, script, *args, str(path))
        except subprocess.TimeoutExpired as e:   # once: the next test of the key must not wait again
            cache[key] = {"_launch": f"no report after {e.timeout:.0f} s (a hang)"}
            return cache[key]
        if run.returncode != 0 or not path.exists():
            cache[key] = {"_launch": f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"}
        else:
            cache[key] = json.loads(path.read_text())
    return cache[key]


def check_group(report: dict, key: str) -> None:
    """A group of a report passed: the launch worked and no case of the group failed."""
    assert "_launch" not in report, report.get("_launch")
    assert key in report, f"no result for {key}"
    assert report[key] == [], "\n".join(report[key][:20])
