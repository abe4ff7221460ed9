#!/usr/bin/env bash
# Run the pipeline's GPU stages through Snakemake on a GPU box (no vLLM needed: transformers
# backends) on a random-weight 1B-class Llama, then print throughputs from the rules' own
# benchmark files. Usage: bash bench/gpu_pipeline.sh [extra snakemake args]
# Expects snakemake/speculators/datasets importable (a venv, or PYTHONPATH with carried wheels).
# BENCH_SMOKE=1 runs the same flow on CPU with the tiny preset and small settings: what to try
# before spending GPU time (it proves the wiring, not the speed).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/.work/bin
PYBIN="${PYTHON:-$(command -v python3)}"
# Rules call `python`; a wrapper (not a symlink: a venv's python must keep its own path).
printf '#!/bin/sh\nexec "%s" "$@"\n' "$PYBIN" > bench/.work/bin/python && chmod +x bench/.work/bin/python
export PATH="$PWD/bench/.work/bin:$PATH" HF_HUB_OFFLINE=1
CONFIGS=(bench/gpu_config.yaml)
if [[ "${BENCH_SMOKE:-0}" == 1 ]]; then
  export BENCH_PRESET=tiny NGPU=0
  CONFIGS+=(bench/cpu_smoke.yaml)
fi
NGPU="${NGPU:-$(nvidia-smi -L | wc -l)}"
PRESET="${BENCH_PRESET:-1b}"
# The target dir name stays target-1b (gpu_config.yaml points there); target.preset says which preset it holds.
if [[ "$(cat bench/.work/target.preset 2>/dev/null)" != "$PRESET" ]]; then
  rm -rf bench/.work/target-1b bench/.work/results
  start=$SECONDS
  python scripts/make_tiny_target.py --out bench/.work/target-1b --preset "$PRESET"
  echo "target build: $((SECONDS - start)) s"
  echo "$PRESET" > bench/.work/target.preset
fi
start=$SECONDS
python -m snakemake results/gpu-1b/drafts/default/train_metrics.csv --configfile "${CONFIGS[@]}" \
  -d bench/.work --cores "$(nproc)" --resources gpu="$NGPU" "$@"
echo "snakemake: $((SECONDS - start)) s"
python bench/summarize_benchmarks.py bench/.work/results/gpu-1b
