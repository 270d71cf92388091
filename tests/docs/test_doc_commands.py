"""The documentation runs (make test-docs): every fenced block that its marker, or its being a
sh/bash block without one, says runs (tests/support/docblocks.py), one test per block, as a
new user would run it: bash -euo pipefail from the repository's top level, with a fresh HOME
(so a fresh ~/.cache: pccl's self-calibration and caches start empty) and none of the
environment's PCCL_* settings. A block fails on a non-zero exit or a Python traceback in its
output.

Each block runs in a scratch directory of its own holding links to the repository's tracked
top-level entries and .venv (the venv running the tests), so what it writes (--out DIR,
out.json, runs/) lands there and not in the checkout; its .cache/ (prepared corpora) is one
for the whole stage (project_cache). $DOC_TEST_REPO names the
checkout itself, for a block that must run there (make: a build from the scratch directory
would point the editable install at it)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import docblocks

pytestmark = pytest.mark.docs

TIMEOUT = 300      # seconds per block; the longest takes about 1.5 minutes on 2 idle cores
TAIL = 40          # output lines shown when a block fails


def runnable() -> list:
    """(block, its script, the blocks that ran its other commands) of every block that
    runs, in page order. A command that an earlier block runs word for word (a README
    line that a page of docs/ repeats) runs there only: it would do the same again. A block
    whose marker is wrong is left to test_doc_markers.py, which names it."""
    found, ran = [], {}
    for path in docblocks.doc_files():
        try:
            for block in docblocks.blocks(path):
                p = docblocks.plan(block)
                if p.kind == "run":
                    found.append((block, docblocks.script(block, p)))
        except docblocks.MarkerError:
            pass
    out = []
    for block, text in found:
        if block.lang == "python":
            out.append((block, f"python - <<'DOC_TEST_EOF'\n{text}\nDOC_TEST_EOF", []))
            continue
        kept, elsewhere = [], []
        for command in docblocks.commands(text):
            same = docblocks.identity(command)
            if same in ran:
                elsewhere.append(ran[same])
            else:
                kept.append(command)
                ran.setdefault(same, block.id) if same is not None else None
        out.append((block, "\n".join(kept), sorted(set(elsewhere))))
    return out


RUN = runnable()


@pytest.fixture(scope="session")
def project_cache(tmp_path_factory) -> Path:
    """The checkout's .cache (the corpora shard-train and its kin prepare), one for the
    whole stage, as for a user who runs the pages' commands in one checkout: the first
    block that trains prepares the corpus, the others read it (pccl's own cache is in
    each block's fresh HOME). Shared by the workers of a parallel run."""
    root = tmp_path_factory.getbasetemp()
    return (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "project-cache"


def scratch(tmp_path: Path, project_cache: Path) -> Path:
    """A working directory that looks like the checkout's top level."""
    work = tmp_path / "work"
    work.mkdir()
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=docblocks.ROOT, capture_output=True, check=True).stdout
    for name in {f.split("/")[0] for f in tracked.decode().split("\0") if f}:
        (work / name).symlink_to(docblocks.ROOT / name)
    (work / ".venv").symlink_to(sys.prefix)
    project_cache.mkdir(exist_ok=True)
    (work / ".cache").symlink_to(project_cache)
    return work


def environment(home: Path) -> dict:
    """The caller's environment less pccl's settings (the suite's conftest points
    PCCL_CACHE_DIR at the suite's own cache; a block starts from none, as a new user), a
    surrounding MPI job's variables and XDG_CACHE_HOME; a fresh HOME, the venv's bin/ first on
    PATH, one thread per process."""
    drop = ("PCCL_", "PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "OMPI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k != "XDG_CACHE_HOME"}
    bin_dir = str(Path(sys.executable).parent)
    return dict(env, HOME=str(home), PATH=f"{bin_dir}:{env.get('PATH', '')}", OMP_NUM_THREADS="1",
                DOC_TEST_REPO=str(docblocks.ROOT))


@pytest.mark.parametrize("block, text, elsewhere", RUN, ids=[b.id for b, _, _ in RUN])
def test_block_runs(block, text, elsewhere, tmp_path, project_cache):
    if not text:
        pytest.skip(f"each of its commands runs, word for word, in {', '.join(elsewhere)}")
    home = tmp_path / "home"
    home.mkdir()
    # its own session, so a timeout kills mpiexec and every rank
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", text], cwd=scratch(tmp_path, project_cache),
                            env=environment(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        # SIGTERM first: launch/emulate/run.py removes its network namespaces on it
        signal_group(proc, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{block.id}: still running after {TIMEOUT} s\n{tail(out)}")
    finally:
        signal_group(proc, signal.SIGKILL)   # what the block left running
    assert proc.returncode == 0, f"{block.id}: exit status {proc.returncode}\n{tail(out)}"
    assert "Traceback (most recent call last)" not in out, f"{block.id}: a traceback in the output\n{tail(out)}"


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def tail(out: str) -> str:
    lines = out.replace("\r", "\n").splitlines()
    return "\n".join(lines[-TAIL:])
