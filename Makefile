# megatron-operator developer entry points. The README's two set-up commands:
#   make demo   - the local demo: a real control plane (kwok GPU nodes, JobSet) + the operator + a job
#   make test   - unit tests, the torch CPU tests (.venv-torch), then e2e tests against the real local control plane (what CI runs)

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: help venv torch-tests test unit e2e cluster-build helm promtool cluster-up cluster-down demo run lint constraints clean images images-full bench bench-peer

help:
	@echo "make demo | make test | make unit | make e2e | make cluster-up | make cluster-down | make run | make images"

# A Python 3.12 virtualenv with the operator and test extras, pinned by constraints.txt.
$(STAMP): pyproject.toml constraints.txt scripts/find-python.sh
	@py=$$(scripts/find-python.sh) && echo "using $$py" && "$$py" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# setuptools' "Editable installation" notice is informational (our two source roots make it
	@# use an import finder); everything else it or pip says still shows.
	PYTHONWARNINGS='ignore:Editable installation:UserWarning' \
	  $(PY) -m pip install -q -c constraints.txt -e '.[operator,test]'
	@touch $(STAMP)

venv: $(STAMP)

# The trainer's CPU tests that run torch and Megatron-Core (gloo): packed SFT losses, the HF converter
# against transformers, the SDPA paths. Their own venv, pinned by constraints-torch.txt (torch's PyPI
# wheel with its CUDA libraries: about 50 s cold from PyPI, 4.8 GB; docs/benchmarks.md). The project's
# sources come from pytest's pythonpath (pyproject.toml), so nothing is installed from the tree.
TORCH_VENV ?= .venv-torch
TORCH_STAMP := $(TORCH_VENV)/.installed
$(TORCH_STAMP): constraints-torch.txt scripts/find-python.sh
	@py=$$(scripts/find-python.sh) && echo "using $$py" && "$$py" -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q -c constraints-torch.txt torch megatron-core transformers \
	  safetensors tokenizers jinja2 numpy pyyaml pytest pytest-timeout
	@touch $(TORCH_STAMP)

torch-tests: $(TORCH_STAMP)
	MEGATRON_TORCH_TESTS=1 $(TORCH_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	  tests/trainer/test_sft_torch.py tests/trainer/test_hf_torch.py tests/trainer/test_torch_paths.py

unit: helm promtool  # the chart and alert tests need the pinned helm and promtool, nothing else from Go
	$(VENV)/bin/ruff check operator trainer_image tests e2e bench scripts
	$(PY) -m pytest tests -q

cluster-build: $(STAMP)
	$(PY) e2e/cluster/cluster.py build

helm: $(STAMP)
	$(PY) e2e/cluster/cluster.py build helm

promtool: $(STAMP)
	$(PY) e2e/cluster/cluster.py build promtool

e2e: cluster-build
	$(PY) -m pytest e2e -q -m e2e

# What CI runs (.ci/run calls exactly this).
test: unit torch-tests e2e

cluster-up: cluster-build
	$(PY) e2e/cluster/cluster.py up

cluster-down:
	$(PY) e2e/cluster/cluster.py down

demo: cluster-build
	$(PY) e2e/demo.py

# The operator against the cluster of the current kubeconfig.
run: $(STAMP)
	$(VENV)/bin/megatron-operator run

# The operator image with buildah on a stand-in base, pip offline from a wheelhouse (no Docker, no
# daemon; installs buildah/podman/runc/mmdebstrap when missing). docs/install.md.
images:
	scripts/images.sh operator

# The trainer image too (torch from the wheelhouse: several GB, not in CI; docs/benchmarks.md).
images-full: images
	scripts/images.sh trainer

# Benchmarks (never in CI; docs/benchmarks.md). The peer, Kubeflow Trainer's controller manager, is
# built from the Go module proxy by exact version into the shared cache (about 9 minutes, once).
bench-peer:
	nice -n 10 bash bench/build_trainer.sh

bench: cluster-build bench-peer
	$(PY) bench/operator_latency.py --jobs 100 500 --out bench/results/operator_throughput.json

lint: $(STAMP)
	$(VENV)/bin/ruff check operator trainer_image tests e2e bench scripts
	$(VENV)/bin/lint-imports

constraints:
	rm -rf /tmp/mo-constraints && py=$$(scripts/find-python.sh) && "$$py" -m venv /tmp/mo-constraints
	/tmp/mo-constraints/bin/pip install -q -e '.[operator,test]'
	(echo "# Pinned versions of everything the operator and test extras install (what CI tested)."; \
	 echo "# Regenerate: make constraints (pip freeze of a fresh virtualenv)."; \
	 /tmp/mo-constraints/bin/pip freeze --exclude-editable) > constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache
