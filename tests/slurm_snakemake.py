"""Snakemake's command line with the SLURM executor plugin's status-poll back-off capped:
how tests/test_slurm.py starts its runs (`python tests/slurm_snakemake.py <snakemake args>`).

snakemake-executor-plugin-slurm (2.8.0) waits 10 s longer after every status check that saw no
job finish (up to 180 s, not configurable) and goes back to
`slurm-init-seconds-before-status-checks` when one did. Good for a busy controller; on the
test's one-node cluster, where each run waits on a chain of 20-90 s jobs, it left the run idle
10-30 s after each job had ended (measured on a 2-core CPU machine, 2026-12-04: every step of the
pipeline's chain). Capped here at POLL_CAP_S; everything else (sbatch, the status command,
the jobs themselves) is the plugin's own, unchanged."""
from __future__ import annotations

import sys

import snakemake.cli
import snakemake_executor_plugin_slurm as slurm_plugin

POLL_CAP_S = 3


def cap_status_poll_backoff(cap_s: float = POLL_CAP_S) -> None:
    interval = slurm_plugin.Executor.next_seconds_between_status_checks  # RemoteExecutor's property
    slurm_plugin.Executor.next_seconds_between_status_checks = property(
        interval.fget, lambda executor, seconds: interval.fset(executor, min(seconds, cap_s)))


if __name__ == "__main__":
    cap_status_poll_backoff()
    sys.exit(snakemake.cli.main(sys.argv[1:]))
