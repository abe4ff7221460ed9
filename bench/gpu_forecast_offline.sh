#!/usr/bin/env bash
# The forecast table on a GPU node without network, as one detached run: unpack the offline
# bundle (`make bundle`), then bench/forecast_shapes.py over the entries of $FORECAST_ENTRIES
# (most important first, each within $ENTRY_BUDGET_S), results under $WORK/shapes as each
# entry finishes. bench/gpu_forecast_collect.sh packs what exists.
#   BUNDLE   the bundle's directory (parts, manifest, SHA256SUMS, offline_bundle.py)
#   TOKENIZER  a HF dir with tokenizer files (the demo target's); PROMPTS  eval prompts jsonl
#   WORK     where everything goes (default /tmp/forecast-run)
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/forecast-run}
source bench/detached.sh
stop_earlier_steps "$WORK"
mkdir -p "$WORK"
t0=$(date +%s)
if [[ ! -f $WORK/node/env.sh ]]; then
  python3 "$BUNDLE/offline_bundle.py" unpack "$BUNDLE" --dest "$WORK/node" --target "$WORK/site" > "$WORK/unpack.log" 2>&1 \
    || { tail -20 "$WORK/unpack.log"; exit 1; }
fi
echo "unpack and install $(( $(date +%s) - t0 )) s" | tee -a "$WORK/steps.log"
rm -rf "$WORK/repo" && mkdir -p "$WORK/repo" && cp -a . "$WORK/repo/" && rm -rf "$WORK/repo/bundle"
args=()
for e in ${FORECAST_ENTRIES:?set FORECAST_ENTRIES}; do args+=(--entry "$e"); done
cat > "$WORK/steps.sh" <<STEPS
source $WORK/node/env.sh
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1
cd $WORK/repo
python bench/forecast_shapes.py --tokenizer $TOKENIZER --prompts $PROMPTS --out $WORK/shapes \
  --budget-s ${ENTRY_BUDGET_S:-600} ${FORECAST_ARGS:-}$(printf ' %q' "${args[@]}") > $WORK/shapes.log 2>&1
echo "shapes rc=\$? at \$(( \$(date +%s) - $t0 )) s" >> $WORK/steps.log
touch $WORK/DONE
STEPS
start_steps "$WORK" "$WORK/steps.sh" "$WORK/steps.out"
