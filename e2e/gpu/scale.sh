#!/usr/bin/env bash
# Issue 49's scale runs on 4 (or 8) GPUs, a 7B-class GPT and the Llama-3-8B shape; one device call per stage, each
# inside a 10-minute call (carry [".whl", ".run"] as for run_on_device.sh; .run holds Megatron-LM for throughput).
#   GPUS=4 bash e2e/gpu/scale.sh goodput        # dd, a full volume (exit 8), then one 7B job over three attempts:
#                                               # kill -9 -> resume, SIGTERM -> final save, TP2xPP2 -> TP4 (goodput)
#   GPUS=4 bash e2e/gpu/scale.sh throughput-a   # ours vs Megatron-LM, global batch 32: Llama-8B TP2xDP2, GPT-7B TP2xPP2
#   GPUS=4 bash e2e/gpu/scale.sh throughput-b   # the same for GPT-7B TP2xPP2 with VPP 2, TP4 and PP4
# Context parallelism needs Transformer Engine (Megatron's local attention asserts CP == 1), so no CP layout runs
# on the TE-less image.
set -uo pipefail
cd "$(dirname "$0")/../.."
GPUS="${GPUS:-4}"
STAGE="${1:?stage: goodput | throughput-a | throughput-b}"
if [ "$GPUS" -ge 8 ]; then FROM="tp2pp2dp$((GPUS / 4))"; TO="tp4pp2dp$((GPUS / 8))"; else FROM="tp2pp2"; TO="tp4"; fi
tw=(--threeway-gbs 32 --threeway-iters 14 --threeway-skip-overlap --deadline-s 530)
case "$STAGE" in
  goodput)      exec bash e2e/gpu/run_on_device.sh --gpus "$GPUS" --only disk,diskfull,goodput --model gpt7b \
                  --reshard-from "$FROM" --reshard-to "$TO" --deadline-s 540 --stop-on-failure none ;;
  throughput-a) exec bash e2e/gpu/run_on_device.sh --gpus "$GPUS" --only threeway "${tw[@]}" \
                  --threeway tp2dp2:llama8b,tp2pp2:gpt7b --threeway-fallback llama8b_s2k ;;
  throughput-b) exec bash e2e/gpu/run_on_device.sh --gpus "$GPUS" --only threeway "${tw[@]}" \
                  --threeway tp2pp2vpp2:gpt7b,tp4:gpt7b,pp4:gpt7b ;;
  *) echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
