#!/usr/bin/env bash
# Reproduce the whole MI355X study (shared seed: DFlash + MXFP4 on Qwen3.5-27B and 35B-A3B) with one
# command, on a machine with an AMD Instinct MI355X, ROCm vLLM installed (`vllm serve` on PATH), and a
# Hugging Face token with read access (HF_TOKEN or `hf auth login`).
#
#   bash scripts/reproduce_mi355x.sh [--publish]
#
# For each recipe: resolve (download target + drafter at pinned revisions), quantize to MXFP4 with
# Quark, pair, validate (vLLM servers: AR, MTP 3/7/15, DFlash 3/7/15 tokens; bf16 and MXFP4; five
# workloads x 128 prompts x up to 4096 tokens; concurrency 1 and 32) and gate. With --publish, the
# gated checkpoints are then published in one job (set [publish] repo_id in each recipe first).
# Re-running resumes: finished stages are skipped.
#
# On a Ray cluster: with RAY_ADDRESS set (e.g. `auto` on a node of a running cluster, see the README's
# "Running on a cluster"), validate's cells run as Ray tasks, one per server, each reserving its
# server's GPUs, and file-to-file quantization runs one task per shard. Every node needs ROCm vLLM,
# mxspec with its [ray] extra, and this folder and the Hub cache (HF_HOME) on shared storage.
#
# Expected run time: `mxspec plan RECIPE` estimates it from the recipe's [plan] rates (not measured
# here: no MI355X was available to this project); for the 27B recipe about 19 h of serving on one GPU
# and 3.8 h on one 8-GPU node, plus quantization (~1 h each, file-to-file) and downloads. Lower
# validation.num_prompts to trade statistical power for time (the gate reports inconclusive when
# prompts are too few).
set -euo pipefail
cd "$(dirname "$0")/.."
MXSPEC=${MXSPEC:-mxspec}
recipes=(recipes/qwen3.5-27b-mxfp4.toml recipes/qwen3.5-35b-a3b-mxfp4.toml)
executor=(--executor local)
if [[ -n "${RAY_ADDRESS:-}" ]]; then
  executor=(--executor ray --ray-address "$RAY_ADDRESS")
  echo "cells run on the Ray cluster at $RAY_ADDRESS"
fi
status=0
for recipe in "${recipes[@]}"; do
  name=$(basename "$recipe" .toml)
  echo "== $name"
  "$MXSPEC" plan "$recipe" --gpus 8 | grep "^wall time" || true
  "$MXSPEC" run "$recipe" --out "runs/$name" --until gate "${executor[@]}" || status=$?
done
if [[ "${1:-}" == "--publish" ]]; then
  "$MXSPEC" publish "${recipes[0]}=runs/$(basename "${recipes[0]}" .toml)" "${recipes[1]}=runs/$(basename "${recipes[1]}" .toml)" || status=$?
fi
echo "reports: runs/*/validate/report.md; gate summaries: runs/*/gate/summary.md"
exit "$status"
