# shellcheck shell=bash
# Sourced by bench/gpu_vllm_offline.sh and bench/gpu_recipe_offline.sh: their steps run detached
# (setsid) in a process group of their own, whose id the steps record in $WORK/steps.pgid. A rerun
# stops exactly that group (the earlier run's steps, Snakemake and every job below it) and nothing
# else: no process is picked by its name.

# The ids of the processes in process group $1.
group_members() {
  ps -eo pid=,pgid= | awk -v g="$1" '$2 == g { print $1 }'
}

# Ends the earlier run's steps in $WORK (absolute), if they still run: SIGTERM to their process
# group, then SIGKILL to what is left after 60 s. The recorded group is ended only while one of
# its processes still runs inside $WORK (the steps run there), so a stale id that the system has
# since given to another process group is left alone.
stop_earlier_steps() {
  local work=$1 pgid pid ours=0
  [[ -f $work/steps.pgid ]] || return 0
  pgid=$(<"$work/steps.pgid")
  rm -f "$work/steps.pgid"
  [[ $pgid =~ ^[1-9][0-9]*$ ]] || return 0
  for pid in $(group_members "$pgid"); do
    [[ $(readlink "/proc/$pid/cwd" 2>/dev/null) == "$work"/* ]] && { ours=1; break; }
  done
  (( ours )) || return 0
  echo "stopping the earlier run's steps (process group $pgid)"
  kill -TERM -- "-$pgid" 2>/dev/null
  for _ in $(seq 60); do
    [[ -z $(group_members "$pgid") ]] && return 0
    sleep 1
  done
  kill -KILL -- "-$pgid" 2>/dev/null
  sleep 1
}

# Starts the steps script $2 detached, in a session and process group of its own (they outlive
# this script), logging to $3; records that process group in $1/steps.pgid.
start_steps() {
  local work=$1 script=$2 log=$3
  # shellcheck disable=SC2016  # expanded by the detached bash, not here
  setsid bash -c 'ps -o pgid= -p $$ | tr -d " " > "$1/steps.pgid" && exec bash "$2"' start_steps "$work" "$script" \
    > "$log" 2>&1 < /dev/null &
  echo "started: the steps run detached (log $log, process group in $work/steps.pgid)"
}
