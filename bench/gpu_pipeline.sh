#!/usr/bin/env bash
# Run the pipeline's GPU stages through Snakemake on a GPU box (no vLLM needed: transformers
# backends) on a random-weight 1B-class Llama, then print throughputs from the rules' own
# benchmark files. Usage: bash bench/gpu_pipeline.sh [extra snakemake args]
# Expects snakemake/speculators/datasets importable (a venv, or PYTHONPATH with carried wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/.work/bin
PYBIN="${PYTHON:-$(command -v python3)}"
# Rules call `python`; a wrapper (not a symlink: a venv's python must keep its own path).
printf '#!/bin/sh\nexec "%s" "$@"\n' "$PYBIN" > bench/.work/bin/python && chmod +x bench/.work/bin/python
export PATH="$PWD/bench/.work/bin:$PATH" HF_HUB_OFFLINE=1
NGPU="$(nvidia-smi -L | wc -l)"
[[ -f bench/.work/target-1b/config.json ]] || python scripts/make_tiny_target.py --out bench/.work/target-1b --preset 1b
python -m snakemake results/gpu-1b/drafts/default/train_metrics.csv --configfile bench/gpu_config.yaml \
  -d bench/.work --cores "$(nproc)" --resources gpu="$NGPU" "$@"
python bench/summarize_benchmarks.py bench/.work/results/gpu-1b
