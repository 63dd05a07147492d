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

.PHONY: venv slurm test test-fast demo clean-venv

venv: $(STAMP)

$(STAMP): setup.py Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first and pinned: an unpinned torch would pull several GB of CUDA packages.
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	@# open3d needs libusb at import time; install Debian's package when it is missing and we can.
	@if ! ldconfig -p 2>/dev/null | grep -q libusb-1.0.so.0; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && apt-get install -y -qq libusb-1.0-0) >/dev/null; \
	  else echo "warning: libusb-1.0-0 is missing; install it (apt-get install libusb-1.0-0) for open3d"; fi; \
	fi
	$(PY) -m pip install -q -e ".[$(EXTRAS),test]"
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

test: venv slurm
	$(PY) -m pytest -q tests

demo: venv
	$(PY) tools/demo.py

clean-venv:
	rm -rf $(VENV)
