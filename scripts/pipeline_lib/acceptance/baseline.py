"""The baseline file: the target's greedy run without speculation (outputs, batch and
concurrency-1 timings), measured once by the acceptance_baseline job and read by every
variant's acceptance job whose BASELINE_KEYS settings are the same."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..errors import PipelineError
from ..io import read_json
from .inputs import MeasureSpec
from .job import BASELINE_KEYS, baseline_settings
from .records import BackendFailure, RunResult, run_from_json, run_to_json

FORMAT = 2  # 2: nothing timed (the speedup is measured in the acceptance job)


def prompts_digest(spec: MeasureSpec) -> str:
    """The prompts measured, as the engine saw them: ids and token ids, in order."""
    rows = [[p.id, p.token_ids] for p in spec.prompts]
    return "sha256:" + hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def baseline_body(spec: MeasureSpec, settings: dict, run: RunResult | None, notes: list[str]) -> dict[str, Any]:
    return {"format": FORMAT, "backend": settings["backend"], "settings": baseline_settings(settings),
            "num_prompts": len(spec.prompts), "prompts_digest": prompts_digest(spec),
            "no_draft": run_to_json(run) if run is not None else None, "notes": notes}


def load_baseline(path: str | Path, spec: MeasureSpec, settings: dict) -> RunResult:
    """The no-speculation RunResult for this measurement. A baseline measured with other
    settings or on other prompts is refused (its numbers would not compare); a baseline that
    failed is the acceptance's failure, as when the run was part of the acceptance job."""
    record = read_json(path, "baseline file (--baseline; the acceptance_baseline rule writes it)")
    if record.get("format") != FORMAT:
        raise PipelineError(f"{path}: baseline format {record.get('format')!r}, expected {FORMAT}; "
                            f"rerun acceptance_baseline (delete the file)")
    differing = sorted(k for k in BASELINE_KEYS if record["settings"].get(k) != settings[k])
    if differing:
        raise PipelineError(f"{path}: baseline measured with other verify settings ({', '.join(differing)}); "
                            f"the acceptance rule must name the baseline of its own settings (rules/common.smk)")
    if record.get("status") == "error":
        raise BackendFailure(record["error_run"], record["error"], record.get("error_log_tail"))
    if record["prompts_digest"] != prompts_digest(spec):
        raise PipelineError(f"{path}: baseline measured on other prompts than these ({record['num_prompts']} "
                            f"prompts, {record['prompts_digest']}); rerun acceptance_baseline")
    return run_from_json(record["no_draft"])
