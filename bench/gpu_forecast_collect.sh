#!/usr/bin/env bash
# Waits up to $1 seconds (default 500) for the detached forecast run in $WORK to finish, then packs
# its small results (each entry's forecast.json/.md/.png, logs' tails, the table) into
# $2/forecast-results.tgz, whether it finished or not.
set -uo pipefail
WORK=${WORK:-/tmp/forecast-run}
end=$(( $(date +%s) + ${1:-500} ))
while [[ ! -f $WORK/DONE && $(date +%s) -lt $end ]]; do sleep 5; done
cd "$WORK" || exit 1
python3 "$WORK/repo/bench/forecast_shapes.py" --out "$WORK/shapes" --summarize > /dev/null 2>&1
for f in shapes/*/work/server-*.log; do [[ -f $f ]] && tail -c 20000 "$f" > "$f.tail"; done
tar czf "${2:?}/forecast-results.tgz" steps.log shapes.log unpack.log shapes/forecast_table.md shapes/runs-*.json \
  shapes/*/forecast.json shapes/*/forecast.md shapes/*/forecast.png shapes/*/forecast.log shapes/*/work/*.tail shapes/*/work/partial.json 2>/dev/null
ls -la "$2"; cat steps.log; tail -5 shapes.log; [[ -f DONE ]] && echo DONE
