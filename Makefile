# One entry point for set-up, tests and the demo. `make venv` is idempotent: it rebuilds only when
# setup.py or this Makefile changed since the last successful install.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SLURM_STAMP := $(VENV)/.slurm
TORCH_VERSION ?= 2.13.0
# cpu here; `make venv EXTRAS=cuda` on a GPU machine after installing a CUDA torch by hand.
EXTRAS ?= cpu

.PHONY: venv slurm check-pins test test-fast test-gpu-torch demo gpu-venv gpu-wheels gpu-check gpu-tests clean-venv

venv: $(STAMP)

$(STAMP): setup.py Makefile tools/ci/pins.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first and pinned: an unpinned torch would pull several GB of CUDA packages. With EXTRAS=cuda a torch
	@# already in the venv (the CUDA build that matches the machine, installed by hand) is kept.
	@if [ "$(EXTRAS)" = cuda ] && $(PY) -c "import torch" 2>/dev/null; then \
	  echo "keeping the installed torch $$($(PY) -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"; \
	else $(PY) -m pip install -q "torch==$(TORCH_VERSION)"; fi
	@# open3d needs libusb at import time; install Debian's package when it is missing and we can.
	@if ! ldconfig -p 2>/dev/null | grep -q libusb-1.0.so.0; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && apt-get install -y -qq libusb-1.0-0) >/dev/null; \
	  else echo "warning: libusb-1.0-0 is missing; install it (apt-get install libusb-1.0-0) for open3d"; fi; \
	fi
	$(PY) -m pip install -q -e ".[$(EXTRAS),test]"
	@# spconv's CUDA wheel follows torch.version.cuda (tools/ci/pins.py); the cpu extra pins the CPU wheel itself.
	@if [ "$(EXTRAS)" = cuda ]; then $(PY) -m pip install -q "$$($(PY) tools/ci/pins.py spconv)"; fi
	@touch $(STAMP)

# tests/test_slurm.py starts a private one-node cluster from Debian's slurm-wlm and munge; install them when
# missing and we can (root with apt-get), else warn: that test then skips, saying why. Never fails the build.
slurm: $(SLURM_STAMP)

$(SLURM_STAMP): | $(STAMP)
	@if ! { command -v srun && { command -v slurmd || test -x /usr/sbin/slurmd; }; } >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends slurm-wlm munge) >/dev/null 2>&1 \
	    || echo "warning: apt-get could not install slurm-wlm and munge; test_slurm will skip"; \
	  else echo "warning: slurm-wlm and munge are missing (apt-get install slurm-wlm munge); test_slurm will skip"; fi; \
	fi
	@touch $@

# Every pinned requirement (setup.py, the spconv table of tools/ci/pins.py, TORCH_VERSION) must exist for Python 3.11
# and 3.12 on manylinux x86_64: resolved against the package index without installing anything. pins.py needs only
# the standard library and pip, so where $(PYTHON) has pip it runs without the venv, beside its install (`make test`).
PINS_PY := $(shell $(PYTHON) -m pip --version >/dev/null 2>&1 && echo $(PYTHON) || echo $(PY))

check-pins: $(if $(filter $(PY),$(PINS_PY)),venv)
	$(PINS_PY) tools/ci/pins.py check --torch $(TORCH_VERSION)

# The venv's install and the pins check are independent: both at once (-j2), then the tests.
# The tests run in TEST_WORKERS pytest processes (pytest-xdist; each test whole in one of them, and a process that
# runs out of tests takes some of the other's), each with its share of the cores for torch's threads
# (tests/conftest.py). Much of a test's time is a new interpreter importing torch or a torchrun rendezvous, which
# leaves a core idle: two processes on 2 cores took the suite from 17 min 04 s to 13 min 27 s (docs/benchmarks.md,
# "Test-suite time").
TEST_WORKERS ?= 2
test:
	@$(MAKE) --no-print-directory -j2 venv check-pins
	@$(MAKE) --no-print-directory slurm
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25 tests

# The fast lane: everything but the tests marked slow (multi-process runs, trainings, the SLURM cluster); a few
# minutes on 2 cores. `make test` still runs everything, and CI runs `make test`.
test-fast: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow" tests

# The whole suite here, on the CPU, under the torch and Python of the lent GPU machines (torch 2.11.0+cu130 on
# Python 3.12: the device notes' pip list), before a GPU session spends its minutes: torch's private interfaces
# and dynamo change between releases, and CI runs only TORCH_VERSION. The package index's torch for Linux is a CUDA
# build; with its CUDA libraries it runs on a CPU (about 5.7 GB in the venv). Opt-in, not part of `make test`:
# docs/benchmarks.md, "The suite under the GPU machines' torch". GPU_TORCH_PYTHON: an interpreter of that Python.
GPU_TORCH ?= 2.11.0
GPU_TORCH_PYTHON ?= python3.12
GPU_TORCH_VENV ?= .venv-gpu-torch
GPU_TORCH_STAMP := $(GPU_TORCH_VENV)/.installed-$(GPU_TORCH)

$(GPU_TORCH_STAMP): setup.py
	@test -x $(GPU_TORCH_VENV)/bin/python || $(GPU_TORCH_PYTHON) -m venv $(GPU_TORCH_VENV)
	$(GPU_TORCH_VENV)/bin/python -m pip install -q "torch==$(GPU_TORCH)"
	$(GPU_TORCH_VENV)/bin/python -m pip install -q -e ".[cpu,test]"
	@touch $@

test-gpu-torch: $(GPU_TORCH_STAMP)
	$(GPU_TORCH_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -p no:cacheprovider tests

demo: venv
	$(PY) tools/demo.py

# The CUDA path proven in one command: tools/gpu_check.py writes $(GPU_CHECK_OUT)/gpu_check.md and .json.
# `make gpu-check` uses .venv; on a GPU machine whose CUDA torch is preinstalled and that reaches no package
# registry, `make gpu-check WHEELS=<folder>` first makes $(GPU_VENV): a venv layered over $(PYTHON), the
# interpreter that holds that torch (also when it is a venv itself, which `venv --system-site-packages` cannot
# see through), with what the project needs and the machine lacks installed from the folder
# (tools/ci/gpu_venv.py). `make gpu-wheels WHEELS=<folder>`, where pip reaches an index, fills such a folder for
# the target's Python and CUDA (GPU_WHEELS_ARGS; add --have-file with the target's `pip list --format=freeze`
# to leave out what it has); `tools/ci/gpu_venv.py pack` turns that folder into one smaller .wheels.tar.xz, which
# WHEELS= takes as well. DEVICE=cpu runs the same checks on the CPU.
DEVICE ?= cuda
GPU_CHECK_OUT ?= gpu_check
GPU_VENV ?= .venv-gpu
WHEELS ?=
GPU_WHEELS_ARGS ?= --python 3.12 --cuda 13.0
GPU_PY := $(if $(WHEELS),$(GPU_VENV)/bin/python,$(PY))

gpu-venv:
	@test -n "$(WHEELS)" || { echo "error: pass WHEELS=<folder of wheels> (see the Makefile's gpu-check note)"; exit 2; }
	$(PYTHON) tools/ci/gpu_venv.py make $(GPU_VENV) --wheels "$(WHEELS)"

gpu-wheels:
	@test -n "$(WHEELS)" || { echo "error: pass WHEELS=<folder to fill> (see the Makefile's gpu-check note)"; exit 2; }
	$(PYTHON) tools/ci/gpu_venv.py download "$(WHEELS)" $(GPU_WHEELS_ARGS)

gpu-check: $(if $(WHEELS),gpu-venv,venv)
	$(GPU_PY) tools/gpu_check.py --device $(DEVICE) --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

# The tests that need a CUDA device (marker cuda; `make test` skips them), on the GPU machine's venv as gpu-check.
gpu-tests: $(if $(WHEELS),gpu-venv,venv)
	$(GPU_PY) -m pytest -q -m cuda -p no:cacheprovider tests

clean-venv:
	rm -rf $(VENV)
