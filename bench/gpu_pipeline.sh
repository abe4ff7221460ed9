#!/usr/bin/env bash
# The GPU stages through Snakemake on a GPU node (no vLLM needed: transformers backends) on a
# random-weight 1B-class Llama, and the limits of the same node measured in the same run on the
# same rows. Prints the table (stage, pipeline tok/s, limit tok/s, ratio) and writes it as
# bench/.work/results/gpu-bench/table.{csv,json} (every underlying figure in the JSON).
#   1. short rows (gpu_config.yaml: 2048 chitchat prompts, 128 new tokens): traces
#   2. long rows (gpu_long.yaml: prompts of 1-4k tokens from bench/long_prompts.py, 32 new
#      tokens): traces, tokenize, hidden states, training
#   3. limits (bench/limits.py) on those runs' rows, then the table (bench/summarize_benchmarks.py)
# Usage: bash bench/gpu_pipeline.sh [extra snakemake args]
# Expects snakemake/speculators/datasets importable (a venv, or PYTHONPATH with the wheels installed).
# BENCH_SMOKE=1 runs the same flow on CPU with the tiny preset and small settings: what to try
# before spending GPU time (it proves the wiring, not the speed).
set -euo pipefail
cd "$(dirname "$0")/.."
W=bench/.work
mkdir -p "$W/bin"
PYBIN="${PYTHON:-$(command -v python3)}"
# Rules call `python`; a wrapper (not a symlink: a venv's python must keep its own path).
printf '#!/bin/sh\nexec "%s" "$@"\n' "$PYBIN" > "$W/bin/python" && chmod +x "$W/bin/python"
export PATH="$PWD/$W/bin:$PATH" HF_HUB_OFFLINE=1
SHORT=(bench/gpu_config.yaml)
LONG=(bench/gpu_long.yaml)
LONG_ROWS=(--rows 400 --min-tokens 1000 --max-tokens 3900)  # ~1M tokens, ~16 GB of hidden states
if [[ "${BENCH_SMOKE:-0}" == 1 ]]; then
  export BENCH_PRESET=tiny NGPU=0
  SHORT+=(bench/cpu_smoke.yaml)
  LONG+=(bench/cpu_smoke.yaml)
  LONG_ROWS=(--rows 12 --min-tokens 150 --max-tokens 500)
fi
NGPU="${NGPU:-$(nvidia-smi -L | wc -l)}"
PRESET="${BENCH_PRESET:-1b}"
OUT="$W/results/gpu-bench"
failed=()
run() {  # a failed step is reported at the end; the others still run and measure
  local name=$1; shift
  local start=$SECONDS
  echo "== $name ($(date +%T))"
  if "$@"; then echo "== $name: $((SECONDS - start)) s"; else echo "== $name FAILED"; failed+=("$name"); fi
}
# The target dir name stays target-1b (the configs point there); target.preset says which preset it holds.
if [[ "$(cat "$W/target.preset" 2>/dev/null)" != "$PRESET" ]]; then
  rm -rf "$W/target-1b" "$W/results" "$W/long_prompts.jsonl"
  run "target build" python scripts/make_tiny_target.py --out "$W/target-1b" --preset "$PRESET"
  echo "$PRESET" > "$W/target.preset"
fi
smk() { python -m snakemake "$@" -d "$W" --cores "$(nproc)" --resources gpu="$NGPU" --keep-going; }
run "short rows: traces" smk results/gpu-1b/traces/traces.jsonl --configfile "${SHORT[@]}" "$@"
[[ -f "$W/long_prompts.jsonl" ]] || run "long prompts" python bench/long_prompts.py --target "$W/target-1b" \
  --out "$W/long_prompts.jsonl" "${LONG_ROWS[@]}"
run "long rows: traces to training" smk results/gpu-1b-long/drafts/default/train_metrics.csv \
  --configfile "${LONG[@]}" "$@"
run "limit: traces" python bench/limits.py traces --run "$W/results/gpu-1b" --out "$OUT/limits/traces.json"
run "limit: hidden states" python bench/limits.py hidden-states --run "$W/results/gpu-1b-long" \
  $(printf -- '--config %s ' "${LONG[@]}") --out "$OUT/limits/hidden_states.json"
run "limit: training" python bench/limits.py train --run "$W/results/gpu-1b-long" --out "$OUT/limits/train.json"
run "table" python bench/summarize_benchmarks.py --short-run "$W/results/gpu-1b" --long-run "$W/results/gpu-1b-long" \
  --limits "$OUT/limits" --out "$OUT"
if (( ${#failed[@]} )); then echo "FAILED steps: ${failed[*]}"; exit 1; fi
