#!/usr/bin/env python
"""The verification report of one draft variant: one table first (tau per eval suite with its
95% interval, the speedup with its interval or why it is not measured, PASS/FAIL), then the
thresholds, eval suites, acceptance in vLLM (trained vs untrained vs no speculation),
throughput, contract checks, training curves and the provenance chain from prompts to draft.
Each section is a module of pipeline_lib/report/ (document.SECTIONS: their order).

Writes into --out-dir: verification.json (every number), report.md and a self-contained
report.html (plots embedded as PNG; no external links or files); and --schedule
(serving_schedule.json): the k per batch size to serve the draft with, from the run's forecast
(forecast/schedule.py), or why there is none.

Exit status: 0 when the draft passes; 1 AFTER writing the report when a required contract
check failed, when the acceptance backend could not run the draft, or (with
verify.fail_below_threshold: true) when a threshold is missed. Snakemake deletes a failed
job's declared outputs, so a failing report is also kept in <out-dir>/failed/.

    python scripts/make_report.py --settings '{"thresholds": {"min_mean_acceptance_length": 1.2}}' \\
        --variant default --contract R/drafts/default/verify/contract.json \\
        --acceptance R/drafts/default/verify/acceptance.json --metrics R/drafts/default/train_metrics.csv \\
        --provenance R/target/provenance.json ... R/drafts/default/provenance.json \\
        --out-dir R/drafts/default/report
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_write_bytes, atomic_write_json, atomic_write_text, read_json  # noqa: E402
from pipeline_lib.provenance import Provenance  # noqa: E402
from pipeline_lib.forecast import schedule  # noqa: E402
from pipeline_lib.forecast.curve import placement  # noqa: E402
from pipeline_lib.render import render_html, render_markdown  # noqa: E402
from pipeline_lib.report import (build_sections, evaluate_thresholds, load_metrics, make_plots,  # noqa: E402
                                 measured_from_records, provenance_summary, suites_summary, training_summary,
                                 verdict)
from pipeline_lib.secrets import scrub_obj  # noqa: E402


def serving_schedule_record(placed: dict | None, args) -> dict:
    """The schedule with what it was derived from; without a forecast, why there is none."""
    derived = {"forecast": args.forecast, "acceptance": args.acceptance, "draft": args.draft}
    if placed is None:
        return {"ranges": None, "speculative_config": None, "derived_from": derived,
                "advice": "no schedule: the run has no speedup forecast (forecast.enabled: false)"}
    draft_config = None
    if args.draft:
        from pipeline_lib import draft_types
        try:
            draft_config = draft_types.speculative_config_for(args.draft, 1)  # its k set by the schedule
        except PipelineError as err:  # a type vLLM cannot serve: the schedule says so, the report goes on
            return {"ranges": None, "speculative_config": None, "derived_from": derived,
                    "advice": f"no schedule: {err}"}
    out = schedule.from_placements(placed["by_k"], draft_config)
    derived.update(is_forecast=placed["is_forecast"], note=placed["note"], accelerator=placed["accelerator"])
    return {**out, "derived_from": derived}


def main() -> int:
    p = cli.parser(__doc__)
    p.add_argument("--variant", required=True)
    p.add_argument("--contract", required=True, help="verify/contract.json")
    p.add_argument("--acceptance", required=True, help="verify/acceptance.json")
    p.add_argument("--metrics", required=True, help="train_metrics.csv")
    p.add_argument("--provenance", nargs="+", default=[], help="provenance.json files, prompts to draft")
    p.add_argument("--lineage", default="{}", type=cli.json_object,
                   help="JSON: {stage_instances: {stage: directory}, changed_settings: {section.key: value}} "
                        "(rules/common.smk variant_lineage)")
    p.add_argument("--overlaps", nargs="*", default=[], help="eval_suites/<suite>/overlap.json files")
    p.add_argument("--forecast", help="forecast/forecast.json, when the run has a speedup forecast")
    p.add_argument("--draft", help="the trained draft (drafts/<variant>/final): the serving schedule's model")
    p.add_argument("--schedule", help="serving_schedule.json to write (the speculative config for vllm serve)")
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()
    settings = args.settings
    prov = Provenance("report", settings, lineage=args.lineage)

    contract = read_json(args.contract, "contract checks (contract.json)")
    acceptance = read_json(args.acceptance, "acceptance measurement (acceptance.json)")
    metrics = load_metrics(Path(args.metrics))
    prov_paths = [Path(x) for x in args.provenance]
    # The verification stages' own records sit next to their outputs.
    prov_paths += [q for q in (Path(args.contract).with_name("contract.provenance.json"),
                               Path(args.acceptance).with_name("acceptance.provenance.json")) if q.exists()]
    prov_paths += measured_from_records(acceptance, prov_paths)
    prov_rows, chain = provenance_summary(prov_paths)
    prov_records = [read_json(q) for q in prov_paths if q.exists()]
    eval_prompts = next((r.get("settings") or {} for r in prov_records if r.get("rule") == "prompts_eval"), {})

    thresholds = evaluate_thresholds(settings, acceptance)
    placed = placement(read_json(args.forecast, "speedup forecast (forecast.json)"), acceptance) if args.forecast else None
    result = {
        "variant": args.variant,
        "lineage": args.lineage,
        "verdict": verdict(contract, acceptance, thresholds, settings, chain),
        "thresholds": thresholds,
        "fail_below_threshold": bool(settings.get("fail_below_threshold")),
        "contract": contract,
        "acceptance": acceptance,
        "suites": suites_summary(acceptance, [read_json(q, "suite overlap (overlap.json)") for q in args.overlaps],
                                 settings, eval_held_out=bool(eval_prompts.get("eval_held_out")),
                                 eval_source=eval_prompts.get("eval")),
        "training": training_summary(metrics, prov_records),
        "forecast": placed,
        "serving_schedule": serving_schedule_record(placed, args),
        "provenance": {"records": prov_rows, "chain": chain},
        "inputs": {"contract": args.contract, "acceptance": args.acceptance, "metrics": args.metrics,
                   "provenance": [str(q) for q in prov_paths]},
    }
    result = scrub_obj(result)  # the report quotes settings, errors and paths: no credential in them
    plots = make_plots(metrics, acceptance, result["suites"])
    result["plots"] = sorted(plots)
    sections = build_sections(result, plots)
    title = f"Draft verification: {args.variant}"

    out = Path(args.out_dir)
    outputs = {"verification": out / "verification.json", "markdown": out / "report.md", "html": out / "report.html"}
    if args.schedule:
        outputs["schedule"] = Path(args.schedule)
        atomic_write_json(outputs["schedule"], result["serving_schedule"])
    atomic_write_json(outputs["verification"], result)
    atomic_write_text(outputs["markdown"], render_markdown(sections))
    atomic_write_text(outputs["html"], render_html(title, sections, plots))
    prov_inputs = {"contract": args.contract, "acceptance": args.acceptance, "metrics": args.metrics}

    failed_copy = out / "failed"
    if result["verdict"]["passed"]:
        if failed_copy.exists():  # the report of an earlier failing run; this one supersedes it
            shutil.rmtree(failed_copy)
        prov.write(out / "provenance.json", inputs=prov_inputs, outputs=outputs)
        print(f"[report] {args.variant}: PASS; report in {out}", file=sys.stderr)
        return 0
    # Snakemake deletes a failed job's declared outputs: keep a copy (with its own provenance)
    # where it survives, and no provenance.json naming files that are about to vanish.
    copies = {name: failed_copy / path.name for name, path in outputs.items()}
    for name, path in outputs.items():
        atomic_write_bytes(copies[name], path.read_bytes())
    (out / "provenance.json").unlink(missing_ok=True)
    prov.write(failed_copy / "provenance.json", inputs=prov_inputs, outputs=copies)
    print(f"[report] {args.variant}: FAIL: {'; '.join(result['verdict']['reasons'])}. Report written to {out}; "
          f"a copy that survives Snakemake's cleanup of failed outputs is in {failed_copy}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    run_main(main)
