"""The whole suite's environment: auto decides without measuring (a measured choice differs
from run to run, and every new world shape would spend its budget), and nothing is cached
in the user's own cache directory. tests/pccl/test_self_calibration.py turns the
self-calibration on where it tests it."""
import os
import tempfile

os.environ["PCCL_SELF_CALIBRATION"] = "0"
os.environ["PCCL_CACHE_DIR"] = tempfile.mkdtemp(prefix="pccl-test-cache-")
