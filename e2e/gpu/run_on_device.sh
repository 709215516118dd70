#!/usr/bin/env bash
# Run the trainer's GPU suite on a lent device machine (or any host with GPUs, torch and triton).
#   bash e2e/gpu/run_on_device.sh --only probe,layouts,resume [--gpus N] [suite options]
# Needs in the repo root: .whl/megatron_core-0.19.2-*.whl and .run/mcore_peer.py (the peer, for bench);
# carry both (`carry: [".whl", ".run"]`). threeway, stepdump and bench's second peer also need Megatron-LM's
# source at core_v0.19.0 in .run/mlm (`fetch` github:NVIDIA/Megatron-LM, git-ignored, never committed) and
# .run/mlm_peer.sh (../shared/bench/mlm_peer.sh). The scenarios that render pods (pods, preempt, tensorboard,
# hf_pods) also need `megatron-operator render`'s wheels in .whl: pydantic==2.14.3, pydantic-core==2.50.4,
# annotated-types==0.8.0, typing-inspection==0.4.5, google-re2==1.1.20251105 (cp312, manylinux x86_64;
# `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`). hf_logits, hf_train and
# hf_bench need only megatron-core (transformers, safetensors and tokenizers are in the GPU image).
# te.py's scenarios (issue 59) need Transformer Engine installed into /opt/te-site and PYTHONPATH=/opt/te-site, and
# pydantic's wheels above in .whl (TE imports pydantic): e2e/gpu/TE_RUNS.md has the calls in order.
# --object-store (issue 33) also needs .run/versitygw.gz (gzip -9 of `cluster.py build versitygw`'s binary)
# and multi-storage-client's wheels in .whl (`pip download -c constraints-objstore.txt --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 'multi-storage-client[boto3]'`, awscrt left out). Writes results to $OUT (default ./.device/out). The wheels
# go to /opt, not /tmp: the pods scenario mounts a /tmp of its own in each pod.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/.device/out}"
mkdir -p "$OUT"
if [ ! -d /opt/megatron-site/megatron ]; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /opt/megatron-site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  chmod -R a+rX /opt/megatron-site  # the pods scenario runs the trainer as uid 1000
fi
# multi-storage-client and its dependencies (--object-store), in their own target: a warm machine may
# already have /opt/megatron-site from an earlier call without them.
objstore_site=
if ls .whl/multi_storage_client-*.whl >/dev/null 2>&1; then
  objstore_site=/opt/objstore-site
  if [ ! -d $objstore_site/multistorageclient ]; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target $objstore_site \
      $(ls .whl/*.whl | grep -v megatron_core) || { echo "object-store wheel install failed"; exit 1; }
    chmod -R a+rX $objstore_site
  fi
fi
export PYTHONPATH="/opt/megatron-site${objstore_site:+:$objstore_site}:$PWD/trainer_image:$PWD/contract${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off on shared hosts (device README / KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 e2e/gpu/suite.py --out "$OUT" "$@" 2>&1
