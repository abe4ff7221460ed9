#!/usr/bin/env bash
# The forecast's check against a trained draft (bench/forecast_check.py) on a GPU node without
# network, as one detached run: unpack the offline bundle (`make bundle`), build the demo target
# from its GGUF with the pipeline's own target rule, then the check's arms in order of value,
# each written as it finishes. bench/gpu_forecast_check_collect.sh packs what exists.
#   BUNDLE  the bundle's directory (parts, manifest, SHA256SUMS, offline_bundle.py); unset or
#           empty: no unpack (the current environment; BENCH_SMOKE=1 on a CPU)
#   DRAFT   the trained draft (a speculators checkpoint dir, e.g. R/drafts/default/checkpoint)
#   PROMPTS eval prompts jsonl (R/prompts/eval.jsonl)
#   WORK    where everything goes (default /tmp/forecast-check; an absolute path)
#   CHECK_ARGS  more arguments for bench/forecast_check.py (e.g. "--arms target,trained")
# A rerun stops the earlier run's steps first (bench/detached.sh) and keeps the unpacked bundle.
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=$(realpath -m "${WORK:-/tmp/forecast-check}")
DRAFT=$(realpath "${DRAFT:?set DRAFT to the trained draft}") || exit 1
PROMPTS=$(realpath "${PROMPTS:?set PROMPTS to the eval prompts}") || exit 1
# shellcheck source=bench/detached.sh
source bench/detached.sh
stop_earlier_steps "$WORK"
mkdir -p "$WORK"
t0=$(date +%s)
ENV_SH=
if [[ -n ${BUNDLE:-} ]]; then
  python3 "$BUNDLE/offline_bundle.py" unpack "$BUNDLE" --dest "$WORK/node" --target "$WORK/site" > "$WORK/unpack.log" 2>&1 \
    || { tail -20 "$WORK/unpack.log"; exit 1; }
  ENV_SH="source $WORK/node/env.sh"
fi
echo "unpack and install $(( $(date +%s) - t0 )) s" | tee "$WORK/steps.log"
rm -rf "$WORK/repo" && mkdir -p "$WORK/repo"
tar -cf - --exclude=./.venv --exclude=./.whl --exclude=./bundle --exclude=./results --exclude=./bench/.work \
  --exclude=./tests/.cache --exclude=./.snakemake --exclude=./.pytest_cache . | tar -xf - -C "$WORK/repo" || exit 1
R=results/smollm2-135m-demo
cat > "$WORK/steps.sh" <<STEPS
$ENV_SH
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
cd "$WORK/repo"
step() { echo "\$1 rc=\$2 at \$(( \$(date +%s) - $t0 )) s" >> "$WORK/steps.log"; }
python -m snakemake --cores "\$(nproc)" --configfile config.yaml -- $R/target/model > "$WORK/target.log" 2>&1
step target \$?
python bench/forecast_check.py --target $R/target/model --draft "$DRAFT" --prompts "$PROMPTS" \
  --out "$WORK/check" ${CHECK_ARGS:-} > "$WORK/check.log" 2>&1
step check \$?
touch "$WORK/DONE"
STEPS
start_steps "$WORK" "$WORK/steps.sh" "$WORK/steps.out"
