#!/usr/bin/env bash
# The GPU recipe with vLLM on a GPU node without network, and the benchmarks that compare it, in
# one detached run. On a machine with network: `make bundle`; copy the bundle folder (parts,
# manifest, SHA256SUMS, offline_bundle.py) and this checkout to the node. There, from the
# checkout:
#   BUNDLE=/path/to/bundle bash bench/gpu_vllm_offline.sh
# checks and unpacks the bundle into $WORK/node (packages in $WORK/site), copies this checkout to
# $WORK/repo, then starts detached (setsid: the steps outlive this script; stop them with
# `kill -- -$(cat $WORK/steps.pgid)`) the steps, most important first, each with its own log
# under $WORK/logs/:
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
#      report: step 3's figures in less time, for the same-draft agreement with step 4
# `RECIPE_RUN=smollm2-135m-gpu-recipe-vllm bash bench/gpu_recipe_collect.sh` waits for them and
# packs their logs and small results. Settings (environment):
#   BUNDLE        the bundle folder (default: bundle, as `make bundle` writes it)
#   WORK          where everything above goes (default /tmp/eagle3-recipe; an absolute path)
#   STEPS         the steps to run (default "1 2 3 4 5 6"; in less time "1 2 4 5 6 7")
#   SPEEDUP_ARGS  more arguments for step 2 (the 2026-12-05 run: "--streams 1,4,16,64 --seconds 8")
# A rerun first stops the earlier run's steps (the process group they recorded, nothing else),
# keeps the unpacked bundle (unpack checks its stamps) and the recipe's workdir (Snakemake
# resumes it).
set -uo pipefail
t0=$(date +%s.%N)
since() { python3 -c "import time,sys; print(round(time.time()-float(sys.argv[1]),1))" "$t0"; }
BUNDLE=$(realpath "${BUNDLE:-bundle}") || exit 1
WORK=$(realpath -m "${WORK:-/tmp/eagle3-recipe}")
LOGS=$WORK/logs
# shellcheck source=bench/detached.sh
source "$(dirname "$0")/detached.sh"
mkdir -p "$WORK"
stop_earlier_steps "$WORK"
rm -rf "$WORK/repo/bench/.work/recipe/.snakemake/locks"  # the earlier run's, ended above
[[ -d $WORK/repo/bench/.work/recipe ]] && rm -rf "$WORK/recipe-kept" && mv "$WORK/repo/bench/.work/recipe" "$WORK/recipe-kept"
rm -rf "$LOGS" "$WORK/repo"; mkdir -p "$LOGS" "$WORK/repo"
# The checkout without its environments, downloads, bundle and results.
tar -cf - --exclude=./.venv --exclude=./.whl --exclude=./bundle --exclude=./results --exclude=./bench/.work \
  --exclude=./tests/.cache --exclude=./.snakemake --exclude=./.pytest_cache . | tar -xf - -C "$WORK/repo" || exit 1
[[ -d $WORK/recipe-kept ]] && mkdir -p "$WORK/repo/bench/.work" && mv "$WORK/recipe-kept" "$WORK/repo/bench/.work/recipe"
python3 "$BUNDLE/offline_bundle.py" unpack "$BUNDLE" --dest "$WORK/node" --target "$WORK/site" > "$LOGS/unpack.log" 2>&1 \
  || { tail -20 "$LOGS/unpack.log"; exit 1; }
echo "unpack and install $(since) s" | tee "$LOGS/steps.log"
R=bench/.work/recipe/results/smollm2-135m-gpu-recipe-vllm
V=results/smollm2-135m-gpu-recipe-vllm  # Snakemake targets are relative to the recipe's workdir
cat > "$LOGS/steps.sh" <<STEPS
source "$WORK/node/env.sh"
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
cd "$WORK/repo"
step() { echo "step \$1 rc=\$2 \$((SECONDS - s)) s (at \$(python3 -c "import time; print(round(time.time()-$t0))") s)" >> "$LOGS/steps.log"; }
for n in ${STEPS:-1 2 3 4 5 6}; do
  s=\$SECONDS
  case \$n in
  1) RECIPE_OVERLAY=configs/gpu-recipe-vllm.yaml bash bench/gpu_recipe.sh $V/drafts/default/provenance.json \
       $V/prompts/eval.jsonl > "$LOGS/1-dag-draft.log" 2>&1; rc=\$? ;;
  2) python bench/speedup_curve.py --run $R --out "$LOGS/speedup" ${SPEEDUP_ARGS:-} > "$LOGS/2-speedup.log" 2>&1; rc=\$? ;;
  3) RECIPE_OVERLAY=configs/gpu-recipe-vllm.yaml bash bench/gpu_recipe.sh all > "$LOGS/3-dag-verify.log" 2>&1; rc=\$?
     mkdir -p "$LOGS/verify-vllm" && cp -a $R/drafts/default/verify/. "$LOGS/verify-vllm/" ;;
  4) RECIPE_OVERLAY="configs/gpu-recipe-vllm.yaml configs/gpu-recipe-vllm-transformers-verify.yaml" \
       bash bench/gpu_recipe.sh $V/drafts/default/verify/acceptance.json > "$LOGS/4-transformers-verify.log" 2>&1; rc=\$?
     mkdir -p "$LOGS/verify-transformers" && cp -a $R/drafts/default/verify/acceptance.json "$LOGS/verify-transformers/" ;;
  7) RECIPE_OVERLAY=configs/gpu-recipe-vllm.yaml bash bench/gpu_recipe.sh $V/drafts/default/verify/acceptance.json \
       > "$LOGS/7-vllm-acceptance.log" 2>&1; rc=\$?
     mkdir -p "$LOGS/verify-vllm" && cp -a $R/drafts/default/verify/. "$LOGS/verify-vllm/" ;;
  5) python bench/traces_speed.py --target $R/target/model --prompts $R/prompts/train.jsonl --num 2048 \
       --batch-size 512 --vllm --out "$LOGS/traces_speed.json" > "$LOGS/5-traces-speed.log" 2>&1; rc=\$? ;;
  6) python bench/limits.py hidden-states --run $R --config config.yaml --config configs/gpu-recipe.yaml \
       --config configs/gpu-recipe-vllm.yaml --out "$LOGS/hs_limits.json" > "$LOGS/6-hs-limits.log" 2>&1; rc=\$? ;;
  *) echo "no step \$n (steps: 1-7)" >> "$LOGS/steps.log"; rc=2 ;;
  esac
  step \$n \$rc
  touch "$LOGS/STEP-\$n"
done
touch "$LOGS/DONE"
STEPS
start_steps "$WORK" "$LOGS/steps.sh" "$LOGS/steps.out"
