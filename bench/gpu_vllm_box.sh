#!/usr/bin/env bash
# The GPU recipe with vLLM on a GPU node without network (issue 28), and the benchmarks that
# compare it, in one detached run. Expects the offline bundle (`make bundle`) copied to
# $BUNDLE (default /tmp/carry/bundle: parts, manifest, SHA256SUMS, offline_bundle.py). From here:
# check and unpack the bundle into a --target folder, copy this checkout to /tmp/repo, then start
# detached (setsid: the steps outlive this script; bench/gpu_recipe_collect.sh collects them)
# the steps, most important first, each with its own log under /tmp/res/:
#   1. the DAG to the trained draft with vLLM traces and vLLM hidden states
#      (configs/gpu-recipe-vllm.yaml on configs/gpu-recipe.yaml)
#   2. the speedup curve: GuideLLM against `vllm serve`, with and without the draft
#      (bench/speedup_curve.py)
#   3. the rest of the DAG: vLLM acceptance on every suite, the interleaved speedup, the load
#      check, the report
#   4. the same draft measured by the batched transformers backend
#      (configs/gpu-recipe-vllm-transformers-verify.yaml), after the vLLM figures are copied aside
#   5. traces: vLLM against the transformers CUDA-graph loop and plain `generate`
#      (bench/traces_speed.py --vllm)
#   6. hidden states: the transformers backend's forward and the disk, on the run's own rows
#      (bench/limits.py hidden-states), beside the vLLM job's figures
#   7. vLLM's acceptance (and the interleaved speedup) only, without the load check and the
#      report: step 3's figures at less GPU time, for the same-draft agreement with step 4
# BOX_STEPS: the steps to run (default "1 2 3 4 5 6"; with less GPU time "1 2 4 5 6 7"); SPEEDUP_ARGS: more arguments for step 2
# (the 2026-12-05 run: "--streams 1,4,16,64 --seconds 8", to fit its GPU time).
set -uo pipefail
t0=$(date +%s.%N)
since() { python3 -c "import time,sys; print(round(time.time()-float(sys.argv[1]),1))" "$t0"; }
BUNDLE=${BUNDLE:-/tmp/carry/bundle}
pkill -f /tmp/res/steps.sh; pkill -f "snakemake|speedup_curve|traces_speed|limits.py"; sleep 2  # an earlier run's steps
rm -rf /tmp/repo/bench/.work/recipe/.snakemake/locks
# A rerun on the same node keeps the unpacked bundle (unpack checks its stamps) and the recipe's
# workdir (Snakemake resumes it).
[[ -d /tmp/repo/bench/.work/recipe ]] && rm -rf /tmp/recipe-kept && mv /tmp/repo/bench/.work/recipe /tmp/recipe-kept
rm -rf /tmp/res /tmp/repo; mkdir -p /tmp/res
cp -a . /tmp/repo && rm -rf /tmp/repo/bench/.work/c[0-9]*
[[ -d /tmp/recipe-kept ]] && mkdir -p /tmp/repo/bench/.work && mv /tmp/recipe-kept /tmp/repo/bench/.work/recipe
python3 "$BUNDLE/offline_bundle.py" unpack "$BUNDLE" --dest /tmp/node --target /tmp/site > /tmp/res/unpack.log 2>&1 \
  || { tail -20 /tmp/res/unpack.log; exit 1; }
echo "unpack and install $(since) s" | tee /tmp/res/steps.log
R=bench/.work/recipe/results/smollm2-135m-gpu-recipe-vllm
V=results/smollm2-135m-gpu-recipe-vllm  # Snakemake targets are relative to the recipe's workdir
cat > /tmp/res/steps.sh <<STEPS
source /tmp/node/env.sh
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
cd /tmp/repo
step() { echo "step \$1 rc=\$2 \$((SECONDS - s)) s (at \$(python3 -c "import time; print(round(time.time()-$t0))") s)" >> /tmp/res/steps.log; }
for n in ${BOX_STEPS:-1 2 3 4 5 6}; do
  s=\$SECONDS
  case \$n in
  1) RECIPE_OVERLAY=configs/gpu-recipe-vllm.yaml bash bench/gpu_recipe.sh $V/drafts/default/provenance.json \
       $V/prompts/eval.jsonl > /tmp/res/1-dag-draft.log 2>&1; rc=\$? ;;
  2) python bench/speedup_curve.py --run $R --out /tmp/res/speedup ${SPEEDUP_ARGS:-} > /tmp/res/2-speedup.log 2>&1; rc=\$? ;;
  3) RECIPE_OVERLAY=configs/gpu-recipe-vllm.yaml bash bench/gpu_recipe.sh all > /tmp/res/3-dag-verify.log 2>&1; rc=\$?
     mkdir -p /tmp/res/verify-vllm && cp -a $R/drafts/default/verify/. /tmp/res/verify-vllm/ ;;
  4) RECIPE_OVERLAY="configs/gpu-recipe-vllm.yaml configs/gpu-recipe-vllm-transformers-verify.yaml" \
       bash bench/gpu_recipe.sh $V/drafts/default/verify/acceptance.json > /tmp/res/4-transformers-verify.log 2>&1; rc=\$?
     mkdir -p /tmp/res/verify-transformers && cp -a $R/drafts/default/verify/acceptance.json /tmp/res/verify-transformers/ ;;
  7) RECIPE_OVERLAY=configs/gpu-recipe-vllm.yaml bash bench/gpu_recipe.sh $V/drafts/default/verify/acceptance.json \
       > /tmp/res/7-vllm-acceptance.log 2>&1; rc=\$?
     mkdir -p /tmp/res/verify-vllm && cp -a $R/drafts/default/verify/. /tmp/res/verify-vllm/ ;;
  5) python bench/traces_speed.py --target $R/target/model --prompts $R/prompts/train.jsonl --num 2048 \
       --batch-size 512 --vllm --out /tmp/res/traces_speed.json > /tmp/res/5-traces-speed.log 2>&1; rc=\$? ;;
  6) python bench/limits.py hidden-states --run $R --config config.yaml --config configs/gpu-recipe.yaml \
       --config configs/gpu-recipe-vllm.yaml --out /tmp/res/hs_limits.json > /tmp/res/6-hs-limits.log 2>&1; rc=\$? ;;
  esac
  step \$n \$rc
  touch /tmp/res/STEP-\$n
done
touch /tmp/res/DONE
STEPS
setsid bash /tmp/res/steps.sh > /tmp/res/steps.out 2>&1 < /dev/null &
echo started
