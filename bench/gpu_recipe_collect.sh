#!/usr/bin/env bash
# Waits up to $1 seconds (default 540) for bench/gpu_recipe_box.sh's detached steps on the GPU
# node (until /tmp/res/$2 exists, default DONE), then packs their logs and the run's small result
# files (no hidden states, no checkpoints) into $OUT/recipe.tgz. Run it again while steps.log
# shows steps still running. RECIPE_RUN: the run's name (bench/gpu_vllm_box.sh's is
# smollm2-135m-gpu-recipe-vllm).
R=/tmp/repo/bench/.work/recipe/results/${RECIPE_RUN:-smollm2-135m-gpu-recipe}
end=$((SECONDS + ${1:-540}))
while [[ ! -f /tmp/res/${2:-DONE} ]] && (( SECONDS < end )); do sleep 3; done
cat /tmp/res/steps.log 2>/dev/null; tail -5 /tmp/res/recipe.log 2>/dev/null; tail -8 /tmp/res/traces_speed_b*.log /tmp/res/[0-9]-*.log 2>/dev/null
tail -3 /tmp/res/variants.log 2>/dev/null
nvidia-smi --query-gpu=name,memory.used --format=csv
(cd / && find tmp/res "${R#/}" tmp/repo/bench/.work/recipe/.snakemake/log -type f -size -3M -not -path '*hidden_states/*' \
   -not -path '*/checkpoints/*' -not -name '*.safetensors' -not -path '*/target/model/*' -print0 \
   | tar czf "$OUT/recipe.tgz" --null -T -)
ls -la "$OUT"
[[ -f /tmp/res/DONE ]] && echo ALL-DONE || echo STILL-RUNNING
