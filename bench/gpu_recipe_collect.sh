#!/usr/bin/env bash
# Waits up to $1 seconds (default 540) for the detached steps of bench/gpu_recipe_offline.sh or
# bench/gpu_vllm_offline.sh (until $WORK/logs/$2 exists, default DONE), prints their progress, then
# packs their logs and the run's small result files (no hidden states, no checkpoints) into
# $ARCHIVE (default: recipe-results.tgz in the current folder), to copy off the node. Run it again
# while steps.log shows steps still running. WORK: as given to those scripts (default
# /tmp/eagle3-recipe); RECIPE_RUN: the run's name (default smollm2-135m-gpu-recipe;
# bench/gpu_vllm_offline.sh's is smollm2-135m-gpu-recipe-vllm).
WORK=$(realpath -m "${WORK:-/tmp/eagle3-recipe}")
LOGS=$WORK/logs
ARCHIVE=$(realpath -m "${ARCHIVE:-recipe-results.tgz}")
RUN=repo/bench/.work/recipe/results/${RECIPE_RUN:-smollm2-135m-gpu-recipe}
end=$((SECONDS + ${1:-540}))
while [[ ! -f $LOGS/${2:-DONE} ]] && (( SECONDS < end )); do sleep 3; done
cat "$LOGS/steps.log" 2>/dev/null; tail -5 "$LOGS/recipe.log" 2>/dev/null
tail -8 "$LOGS"/traces_speed_b*.log "$LOGS"/[0-9]-*.log 2>/dev/null
tail -3 "$LOGS/variants.log" 2>/dev/null
nvidia-smi --query-gpu=name,memory.used --format=csv
(cd "$WORK" && find logs "$RUN" repo/bench/.work/recipe/.snakemake/log -type f -size -3M -not -path '*hidden_states/*' \
   -not -path '*/checkpoints/*' -not -name '*.safetensors' -not -path '*/target/model/*' -print0 2>/dev/null \
   | tar czf "$ARCHIVE" --null -T -)
ls -la "$ARCHIVE"
[[ -f $LOGS/DONE ]] && echo ALL-DONE || echo STILL-RUNNING
