#!/usr/bin/env bash
# Issue 8's scale run: 3D parallelism end to end on 8 (or 4) GPUs, a 7B-class GPT, one device call per stage.
#   GPUS=8 bash e2e/gpu/scale.sh train     # TP2xPP2xDP2 and its VPP variant: loss falls; kill -9 a rank -> resume
#   GPUS=8 bash e2e/gpu/scale.sh recover   # SIGTERM -> checkpoint -> resume; reshard TP2xPP2 -> TP4xPP2, TP2xPP4
#   GPUS=8 bash e2e/gpu/scale.sh bench     # ours vs ../shared/bench/mcore_peer.py (TP2xDP4 and DP8), same call
# With GPUS=4 the layouts become TP2xPP2xDP1 (the VPP variant included). Context parallelism needs
# Transformer Engine (Megatron's local attention asserts CP == 1), so no CP variant runs on the TE-less image.
# Each stage fits one 10-minute device command; carry [".whl", ".run"] as for run_on_device.sh.
set -uo pipefail
cd "$(dirname "$0")/../.."
GPUS="${GPUS:-8}"
DP=$((GPUS / 4))
STAGE="${1:?stage: train | recover | bench}"
if [ "$GPUS" -ge 8 ]; then RESHARD_TO="tp4pp2dp$((GPUS / 8)),tp2pp4dp$((GPUS / 8))"; else RESHARD_TO="tp4,pp4"; fi
common=(--gpus "$GPUS" --model gpt7b --bench-model gpt7b --reshard-from "tp2pp2dp${DP}" --deadline-s 570)
case "$STAGE" in
  train)   exec bash e2e/gpu/run_on_device.sh "${common[@]}" --only layouts,resume \
             --layouts "tp2pp2dp${DP},tp2pp2vpp2dp${DP}" --resume-on "tp2pp2dp${DP}" ;;
  recover) exec bash e2e/gpu/run_on_device.sh "${common[@]}" --only layouts,sigterm,reshard \
             --layouts "tp2pp2dp${DP}" --reshard-to "$RESHARD_TO" ;;
  bench)   exec bash e2e/gpu/run_on_device.sh "${common[@]}" --only bench ;;
  *) echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
