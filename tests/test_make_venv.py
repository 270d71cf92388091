"""make on a machine whose python3 is itself a virtual environment that holds torch (the GPU
images' setup): the project's .venv must see that environment's packages. A venv made with
--system-site-packages from a venv's python sees only the base interpreter's."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_a_venv_made_from_a_venv_sees_that_environments_packages(tmp_path):
    base = Path(sys.base_prefix) / "bin" / "python3"
    parent, child = tmp_path / "parent", tmp_path / "child"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(parent)], check=True)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([str(parent / "bin" / "python"), "-c", purelib],
                          check=True, capture_output=True, text=True).stdout.strip()
    # A stand-in for the image's torch (only imported, to decide the venv's layout) and a
    # package that exists only in the parent environment.
    (Path(site) / "torch").mkdir()
    (Path(site) / "torch" / "__init__.py").write_text("__version__ = '0.0-stand-in'\n")
    (Path(site) / "only_in_the_parent.py").write_text("VALUE = 42\n")

    made = subprocess.run(["make", "-C", str(ROOT), str(child / "bin" / "python"),
                           f"PYTHON={parent / 'bin' / 'python'}", f"VENV={child}"],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    seen = subprocess.run([str(child / "bin" / "python"), "-c",
                           "import only_in_the_parent, torch; print(only_in_the_parent.VALUE, torch.__version__)"],
                          capture_output=True, text=True)
    assert seen.returncode == 0 and seen.stdout.split() == ["42", "0.0-stand-in"], seen.stderr[-2000:]
    # The child's own installs still come first: its site-packages precedes the parent's.
    order = subprocess.run([str(child / "bin" / "python"), "-c", "import sys; print('\\n'.join(sys.path))"],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    mine = next(i for i, p in enumerate(order) if p.startswith(str(child)))
    assert mine < order.index(site)


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_a_venv_refuses_another_mpi_or_torch_than_it_was_set_up_with(tmp_path):
    """MPI=system after a first `make` with the mpich wheel would keep the wheel (pip finds
    mpi4py installed): refused, naming the venv's choice, before anything runs."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".choice").write_text("MPI=mpich\nTORCH=torch==2.13.0\n")

    def make(*args):
        return subprocess.run(["make", "-C", str(ROOT), "-n", "build", f"VENV={venv}", *args],
                              capture_output=True, text=True, timeout=60)
    for asked in ("MPI=system", "TORCH=torch==2.11.0"):
        refused = make(asked)
        assert refused.returncode != 0 and f"was set up with MPI=mpich TORCH=torch==2.13.0 and cannot take " \
            f"{asked}" in refused.stderr, refused.stderr
    assert make().returncode == 0 and make("MPI=mpich", "TORCH=torch==2.13.0").returncode == 0


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_bench_refuses_ranks_that_are_not_a_count():
    """RANKS=abc (or 0) ran one rank: Hydra's mpiexec reads -n abc as 1."""
    for bad in ("abc", "0", "-2"):
        run = subprocess.run(["make", "-s", "-C", str(ROOT), "bench", f"RANKS={bad}"], capture_output=True,
                             text=True, timeout=300)
        assert run.returncode != 0 and f"RANKS must be a positive integer, got '{bad}'" in run.stderr, run.stderr
