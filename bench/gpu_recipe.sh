#!/usr/bin/env bash
# The GPU quality recipe through Snakemake with the transformers backends: the demo's
# real target, configs/gpu-recipe.yaml (~10k PyPI-shipped training prompts, two turns where the
# sets have them), traces, tokenize, hidden states, training, verification on every eval suite,
# report. Workdir bench/.work/recipe; the run's results under bench/.work/recipe/results/<run_name>/.
# Usage: bash bench/gpu_recipe.sh [snakemake targets; default: the acceptance measurement]
# Expects snakemake/speculators/datasets and the asset packages importable (a venv, or PYTHONPATH
# with those wheels installed on a node without network: bench/gpu_recipe_offline.sh).
# BENCH_SMOKE=1 runs the same flow on CPU with the tests' tiny target and small settings
# (configs/gpu-recipe-smoke.yaml): what to try before spending GPU time; tests/test_gpu_recipe.py.
set -euo pipefail
cd "$(dirname "$0")/.."
W="${RECIPE_WORKDIR:-bench/.work/recipe}"  # tests/test_gpu_recipe.py runs it in a temp dir
mkdir -p "$W/bin"
PYBIN="${PYTHON:-$(command -v python3)}"
PYBIN="$(cd "$(dirname "$PYBIN")" && pwd)/$(basename "$PYBIN")"  # absolute: the wrapper runs from the workdir
# Rules call `python`; a wrapper (not a symlink: a venv's python must keep its own path).
printf '#!/bin/sh\nexec "%s" "$@"\n' "$PYBIN" > "$W/bin/python" && chmod +x "$W/bin/python"
W=$(cd "$W" && pwd)
export PATH="$W/bin:$PATH" HF_HUB_OFFLINE=1
CONFIGS=(config.yaml configs/gpu-recipe.yaml)  # --configfile replaces config.yaml: name it first
RUN=smollm2-135m-gpu-recipe
# RECIPE_OVERLAY: one or more overlays, space-separated, applied in order (e.g.
# configs/gpu-recipe-variants.yaml); the run is the last run_name they set.
for overlay in ${RECIPE_OVERLAY:-}; do
  CONFIGS+=("$overlay")
  RUN=$(python -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1])).get('run_name') or sys.argv[2])" "$overlay" "$RUN")
done
if [[ "${BENCH_SMOKE:-0}" == 1 ]]; then
  CONFIGS+=(configs/gpu-recipe-smoke.yaml)
  RUN=gpu-recipe-smoke
  NGPU=0
  [[ -f "$W/target-tiny/config.json" ]] || python scripts/make_tiny_target.py --out "$W/target-tiny" --preset tiny
fi
NGPU="${NGPU:-$(nvidia-smi -L | wc -l)}"
start=$SECONDS
# Up to the acceptance measurement (every suite): the report's load check needs vLLM, which a
# GPU node without it cannot run; `bash bench/gpu_recipe.sh all` asks for everything.
TARGETS=("${@:-results/$RUN/drafts/default/verify/acceptance.json}")
# RECIPE_ARGS: more Snakemake arguments (e.g. "--until hidden_states_gather").
python -m snakemake -d "$W" --cores "$(nproc)" --resources gpu="$NGPU" --keep-going ${RECIPE_ARGS:-} \
  --configfile "${CONFIGS[@]}" -- "${TARGETS[@]}"
echo "== recipe: $((SECONDS - start)) s"
