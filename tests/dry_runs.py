"""Many Snakemake dry-runs in one interpreter: conftest.plan_together's worker.

A dry-run in a subprocess of its own spends about half its time starting Python and importing
Snakemake; tests that plan dozens of configs against one finished working dir run them here,
one after the other, through Snakemake's own command line entry point (the same arguments the
CLI gets). Reads a JSON list of argument lists, writes a JSON list of
{"returncode", "output"} (stdout and stderr together, as the tests read them)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import snakemake.cli


def dry_run(argv: list[str]) -> dict:
    out = io.StringIO()
    returncode = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            snakemake.cli.main(argv)
        except SystemExit as end:
            returncode = end.code if isinstance(end.code, int) else 1
    return {"returncode": returncode, "output": out.getvalue()}


def main() -> None:
    requests = json.loads(open(sys.argv[1]).read())
    cwd = os.getcwd()
    results = []
    for argv in requests:
        os.chdir(cwd)  # Snakemake enters the working dir (-d); each run starts where the CLI would
        results.append(dry_run(argv))
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
