# megatron-operator developer entry points. The README's two set-up commands:
#   make demo   - the local demo: a real control plane (kwok GPU nodes, JobSet) + the operator + a job
#   make test   - unit tests, the torch CPU tests (.venv-torch), then e2e tests against the real local control plane (what CI runs)

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The object-storage tests' own venv: multi-storage-client's boto3 pins python-dateutil<3, the kubernetes
# client >=3, so they cannot share .venv (docs/object-storage.md).
S3VENV ?= .venv-s3
S3STAMP := $(S3VENV)/.installed

.PHONY: help venv s3-venv s3-test versitygw constraints-objstore constraints-trainer torch-tests test unit e2e cluster-build helm promtool argocd node-build cluster-up cluster-down demo run lint constraints clean images images-full trainer-wheelhouse bench bench-peer

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

$(S3STAMP): constraints-objstore.txt scripts/find-python.sh
	@py=$$(scripts/find-python.sh) && "$$py" -m venv $(S3VENV)
	$(S3VENV)/bin/python -m pip install -q --upgrade pip
	$(S3VENV)/bin/python -m pip install -q -c constraints-objstore.txt 'multi-storage-client[boto3]' pytest pytest-timeout
	@touch $(S3STAMP)

s3-venv: $(S3STAMP)

versitygw: $(STAMP) | promtool
	$(PY) e2e/cluster/cluster.py build versitygw

# Checkpoints in object storage against a real S3 server (versitygw on loopback), through
# multi-storage-client: tracker last, resume, retention, classified errors. No torch (see
# tests/trainer/test_object_store_torch.py for the two-rank torch_dist save/load).
s3-test: s3-venv versitygw
	PYTHONPATH=trainer_image:contract $(S3VENV)/bin/python -m pytest tests/trainer/test_object_store.py -q -p no:cacheprovider

constraints-objstore:
	rm -rf /tmp/mo-constraints-s3 && py=$$(scripts/find-python.sh) && "$$py" -m venv /tmp/mo-constraints-s3
	/tmp/mo-constraints-s3/bin/pip install -q 'multi-storage-client[boto3]' pytest pytest-timeout
	(echo "# Pinned versions of the object-storage test venv (.venv-s3: multi-storage-client + boto3, which"; \
	 echo "# pins python-dateutil<3 against the kubernetes client's >=3, so it cannot share .venv)."; \
	 echo "# Regenerate: make constraints-objstore."; \
	 /tmp/mo-constraints-s3/bin/pip freeze) > constraints-objstore.txt

# The trainer image's pins (Dockerfile.trainer, scripts/images.sh trainer): what pip resolves for the
# `trainer` extra under the torch venv's and the object-storage venv's pins (they agree where they
# overlap), without installing anything (pip's resolver report). The image carries no Kubernetes
# client, so boto3's python-dateutil<3 does not meet the operator's >=3 (constraints.txt) there.
constraints-trainer:
	rm -rf /tmp/mo-constraints-trainer && py=$$(scripts/find-python.sh) && "$$py" -m venv /tmp/mo-constraints-trainer
	/tmp/mo-constraints-trainer/bin/pip install -q --dry-run --ignore-installed --report /tmp/mo-constraints-trainer/report.json \
	  -c constraints-torch.txt -c constraints-objstore.txt '.[trainer]'
	(echo "# Pinned versions of the trainer image's Python packages (the trainer extra, multi-storage-client[boto3]"; \
	 echo "# included; torch and the CUDA wheels for stand-in builds: an NGC base keeps its own, Dockerfile.trainer)."; \
	 echo "# Regenerate: make constraints-trainer (pip's resolver report under constraints-torch.txt + constraints-objstore.txt)."; \
	 /tmp/mo-constraints-trainer/bin/python -c "import json; r = json.load(open('/tmp/mo-constraints-trainer/report.json')); \
	   pins = [m['name'] + '==' + m['version'] for m in (i['metadata'] for i in r['install']) if m['name'] != 'megatron-operator']; \
	   print(chr(10).join(sorted(pins, key=str.lower)))") > constraints-trainer.txt

# The trainer's CPU tests that run torch and Megatron-Core (gloo): packed SFT losses, the HF converter
# against transformers, the SDPA paths. Their own venv, pinned by constraints-torch.txt (torch's PyPI
# wheel with its CUDA libraries, 4.8 GB; docs/benchmarks/ci.md#2026-11-24-8b15b74).
# The project's sources come from pytest's pythonpath (pyproject.toml), so nothing is installed from the tree.
TORCH_VENV ?= .venv-torch
TORCH_STAMP := $(TORCH_VENV)/.installed
# The trainer's packages (torch and its 2.9 GB of CUDA wheels among them) come from the trainer image's
# wheelhouse, which is downloaded once for both (scripts/images.sh wheelhouse trainer: the same pins, as
# constraints-trainer.txt is resolved under these two files); only the test tools come from the index.
# multi-storage-client (object-storage checkpoints) comes with its own pins; the two files agree where
# they overlap (filelock, PyYAML, pytest, tqdm, typing-extensions, ...).
TORCH_FROM_WHEELHOUSE := torch megatron-core tokenizers jinja2 numpy pyyaml 'multi-storage-client[boto3]' wandb tensorboard
$(TORCH_STAMP): constraints-torch.txt constraints-objstore.txt constraints-trainer.txt scripts/find-python.sh \
	  | trainer-wheelhouse
	@py=$$(scripts/find-python.sh) && echo "using $$py" && "$$py" -m venv $(TORCH_VENV)
	wheels=$$(scripts/images.sh wheelhouse trainer) && \
	  $(TORCH_VENV)/bin/python -m pip install -q --no-index --find-links "$$wheels" \
	    -c constraints-torch.txt -c constraints-objstore.txt $(TORCH_FROM_WHEELHOUSE)
	$(TORCH_VENV)/bin/python -m pip install -q -c constraints-torch.txt -c constraints-objstore.txt \
	  $(TORCH_FROM_WHEELHOUSE) transformers safetensors pytest pytest-timeout
	@touch $(TORCH_STAMP)

torch-tests: $(TORCH_STAMP) versitygw
	@# every tests/trainer/test_*_torch.py (a new one is never left out) and test_torch_paths.py
	MEGATRON_TORCH_TESTS=1 $(LANE_NICE) $(TORCH_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	  $(sort $(wildcard tests/trainer/test_*_torch.py)) tests/trainer/test_torch_paths.py

unit: helm promtool s3-venv versitygw  # helm, promtool: chart and alert tests; versitygw: object-storage tests
	$(VENV)/bin/ruff check operator trainer_image contract tests e2e bench scripts
	$(LANE_NICE) $(PY) -m pytest tests -q
	PYTHONPATH=trainer_image:contract $(LANE_NICE) $(S3VENV)/bin/python -m pytest tests/trainer/test_object_store.py -q -p no:cacheprovider

# The Go builds run one at a time (each uses every core; two at once only contend), in the order the test lanes
# need them: helm, promtool and versitygw for the unit tests first. Order-only prerequisites (|): `make unit` alone
# still builds only what it needs.
cluster-build: $(STAMP) | versitygw
	$(PY) e2e/cluster/cluster.py build

helm: $(STAMP)
	$(PY) e2e/cluster/cluster.py build helm

promtool: $(STAMP) | helm
	$(PY) e2e/cluster/cluster.py build promtool

# The real node's kubelet and cluster DNS (e2e/test_node.py, e2e/test_real_training.py).
node-build: $(STAMP) | cluster-build
	$(PY) e2e/cluster/cluster.py build kubelet coredns

# Argo CD (controller, repo server, CLI) for e2e/test_argocd.py; docs/gitops.md.
argocd: $(STAMP) | node-build
	$(PY) e2e/cluster/cluster.py build argocd

# e2e needs the images too: the operator's (e2e/test_image.py, the real node) and the trainer's
# (e2e/test_real_training.py, whose oracle runs in the torch venv).
e2e: cluster-build node-build argocd images-full $(TORCH_STAMP)
	$(PY) -m pytest e2e -q -m e2e

# What CI runs (.ci/run calls exactly this): the unit, torch and e2e lanes at once, so the CPU-bound Go builds
# overlap the network- and disk-bound downloads and image builds, and the unit and torch tests run while the
# control plane is built (docs/benchmarks/ci.md has the measured lanes). Each lane's output is printed whole
# when it ends (--output-sync=target); a lane that fails fails the run, and the others still run to their end (-k:
# one run shows every lane's failures). On 2 cores the lanes contend: the unit and torch tests run at a lower CPU
# priority (LANE_NICE), so the critical path (the Go builds, then e2e, whose real trainer pods are CPU-bound) is
# not slowed by them; they take the cycles it leaves (a cold run measured 4-5x slower Go builds with every lane at
# one priority and helpers beside it: docs/benchmarks/ci.md#2026-12-02-cold).
LANE_NICE ?=
test:
	$(MAKE) --no-print-directory -k -j3 --output-sync=target LANE_NICE='nice -n 10' unit torch-tests e2e

cluster-up: cluster-build
	$(PY) e2e/cluster/cluster.py up

cluster-down:
	$(PY) e2e/cluster/cluster.py down

demo: cluster-build node-build images-full $(TORCH_STAMP)
	$(PY) e2e/demo.py

# The operator against the cluster of the current kubeconfig.
run: $(STAMP)
	$(VENV)/bin/megatron-operator run

# The operator image with buildah on a stand-in base, pip offline from a wheelhouse (no Docker, no
# daemon; installs buildah/podman/runc/mmdebstrap when missing). docs/install.md.
images:
	scripts/images.sh operator

# The trainer image too (torch from the wheelhouse: 5.4 GB; e2e/test_real_training.py runs it on the real node;
# docs/benchmarks/images.md).
images-full: images | trainer-wheelhouse
	scripts/images.sh trainer

# The trainer's wheels, downloaded once for the trainer image and the torch test venv (cached by its inputs).
trainer-wheelhouse:
	scripts/images.sh wheelhouse trainer

# Benchmarks (never in CI; docs/benchmarks.md#operator). The peer, Kubeflow Trainer's controller manager, is
# built from the Go module proxy by exact version into the shared cache (about 9 minutes, once).
bench-peer:
	nice -n 10 bash bench/build_trainer.sh

bench: cluster-build bench-peer
	$(PY) bench/operator_latency.py --jobs 100 500 --out bench/results/operator_throughput.json

lint: $(STAMP)
	$(VENV)/bin/ruff check operator trainer_image contract tests e2e bench scripts
	$(VENV)/bin/lint-imports

constraints:
	rm -rf /tmp/mo-constraints && py=$$(scripts/find-python.sh) && "$$py" -m venv /tmp/mo-constraints
	/tmp/mo-constraints/bin/pip install -q -e '.[operator,test]'
	(echo "# Pinned versions of everything the operator and test extras install (what CI tested)."; \
	 echo "# Regenerate: make constraints (pip freeze of a fresh virtualenv)."; \
	 /tmp/mo-constraints/bin/pip freeze --exclude-editable) > constraints.txt

clean:
	rm -rf $(VENV) $(S3VENV) .pytest_cache
