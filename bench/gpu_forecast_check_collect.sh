#!/usr/bin/env bash
# Waits up to $1 seconds (default 500) for the detached run of bench/gpu_forecast_check.sh in
# $WORK to finish, then packs what exists (the check's record and table, the partial record,
# GuideLLM's per-point JSON, the logs' tails) into $2/forecast-check.tgz, finished or not.
set -uo pipefail
WORK=${WORK:-/tmp/forecast-check}
end=$(( $(date +%s) + ${1:-500} ))
while [[ ! -f $WORK/DONE && $(date +%s) -lt $end ]]; do sleep 5; done
cd "$WORK" || exit 1
for f in check/work/server-*.log target.log unpack.log; do [[ -f $f ]] && tail -c 30000 "$f" > "$f.tail"; done
tar czf "${2:?}/forecast-check.tgz" steps.log check.log ./*.tail check/forecast_check.json check/forecast_check.md \
  check/work/partial.json check/work/guidellm-*.json check/work/*.tail 2>/dev/null
ls -la "$2"; cat steps.log; tail -15 check.log; [[ -f DONE ]] && echo DONE
