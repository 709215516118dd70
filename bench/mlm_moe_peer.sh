#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py with exactly the arguments given: the peer of issue 50's MoE comparison
# (e2e/gpu/moe.py builds the arguments from the same shape as ours' command line; to see both without a GPU:
# `python3 e2e/gpu/moe.py --dry-run --shape qwen3 --layout ep2`).
# A sibling of ../shared/bench/mlm_peer.sh (the dense peer): the same set-up, but no model defaults of its own
# (mlm_peer.sh's are a dense GPT's) and every iteration's time and loss in its result, so that the caller picks the
# timed window.
#
# Needs, on the GPU machine:
#   MLM_DIR  a Megatron-LM source tree at tag core_v0.19.0 (public repository NVIDIA/Megatron-LM: pretrain_gpt.py,
#            gpt_builders.py, model_provider.py, megatron/), kept in a git-ignored folder (.run/mlm). Never commit it.
#   WHL      the megatron_core-0.19.2 wheel (its prebuilt dataset helpers are copied into MLM_DIR, so nothing is
#            compiled at start-up).
# Env: GPUS (default 2), PORT (default 29517), LOG (pretrain_gpt.py's output; default a mktemp file).
# Without Transformer Engine (`--transformer-impl local`) Megatron-LM builds the experts as SequentialMLP, one
# GEMM pair per local expert (`--moe-grouped-gemm` is ignored there: LocalSpecProvider.grouped_mlp_modules).
# Prints one line:  MLM_MOE RESULT {"rc": .., "iter_ms": {"1": ..}, "losses": {"1": ..}, "max_allocated_mb": [..],
#                   "log": ".."}
# "losses" are the logged `lm loss` values; the line of iteration 2 is the mean of iterations 1 and 2 (harness.py,
# mlm_losses_per_iteration). "max_allocated_mb": every report_memory line's max allocated (data-parallel rank 0 of
# each group; after iterations 1, 2 and every --log-memory-interval).
set -uo pipefail
: "${MLM_DIR:?MLM_DIR: Megatron-LM tree}" "${WHL:?WHL: megatron_core wheel}"
GPUS=${GPUS:-2}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=1
python3 - "$WHL" "$MLM_DIR/megatron/core/datasets" <<'PY' || exit 1   # no unzip on the GPU image
import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
so = [n for n in z.namelist() if "datasets/helpers_cpp" in n and n.endswith(".so")][0]
open(os.path.join(sys.argv[2], os.path.basename(so)), "wb").write(z.read(so))
PY
printf 'default:\n\t@true\n' > "$MLM_DIR/megatron/core/datasets/Makefile"   # helpers come prebuilt
log=${LOG:-$(mktemp)}
(cd "$MLM_DIR" && PYTHONPATH="$MLM_DIR" torchrun --nproc-per-node "$GPUS" --master-port "${PORT:-29517}" \
   pretrain_gpt.py "$@") > "$log" 2>&1
rc=$?
python3 - "$log" "$rc" <<'PY'
import json, re, sys
text = open(sys.argv[1], errors="replace").read()
iters = re.findall(r"iteration\s+(\d+)/\s*\d+ \|(.*)", text)
ms = {int(i): float(m.group(1)) for i, rest in iters
      if (m := re.search(r"elapsed time per iteration \(ms\): ([0-9.]+)", rest))}
loss = {int(i): float(m.group(1)) for i, rest in iters if (m := re.search(r"lm loss: ([0-9.E+-]+)", rest))}
peaks = [float(x) for x in re.findall(r"\| max allocated: ([0-9.]+)", text)]
print("MLM_MOE RESULT " + json.dumps({"rc": int(sys.argv[2]), "iter_ms": ms, "losses": loss,
                                      "max_allocated_mb": peaks, "log": sys.argv[1]}))
if not ms:
    print("\n".join(text.splitlines()[-40:]))
PY
exit "$rc"
