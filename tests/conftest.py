"""The whole suite's environment: the product as it ships, every default on (a test that
needs a fixed choice sets it itself and says why), from an empty calibration cache, as on a
fresh machine. Where the cache lives is not a choice the product makes for its users:
the suite's own keeps the runs of developers' tests out of their ~/.cache/pccl (and theirs
out of the suite), and the suite's first calls of each world shape measure it, as a new
user's do."""
import os
import tempfile

os.environ["PCCL_CACHE_DIR"] = tempfile.mkdtemp(prefix="pccl-test-cache-")
