#!/usr/bin/env python
"""Check that a trained draft honours the contract between the pipeline's stages and what
vLLM's speculators loader expects, before anyone measures or ships it.

Writes contract.json: {"passed", "summary", "checks": [{name, passed, expected, seen, detail,
required}], "reference"}. `passed` is true only if every required check passed; a check that
could not run because an earlier one failed has passed = null. The train-vs-serve check
(training_data.matches_serving_render) needs vLLM: where vLLM is not installed it is reported
as not run, saying why, and informational (required false), so a machine without vLLM can still build.
A broken draft (no config.json,
another speculator type, random embeddings, ...) is a result, not a crash: the script writes
contract.json and exits 0; make_report decides whether the build fails. Missing pipeline
inputs other than the draft (manifests, stats) are errors (exit 2).

    python scripts/check_contract.py --settings '{}' --target R/target/model \\
        --target-manifest R/target/manifest.json --draft R/drafts/default/final \\
        --hs-manifest R/hidden_states/manifest.json --tokenized-stats R/tokenized/stats.json \\
        --hs-record R/drafts/default/hidden_states.json --tokenized-data R/tokenized/data \\
        --traces R/traces/traces.jsonl --out R/drafts/default/verify/contract.json

With online training (hidden_states.mode: online) --hs-manifest is the train job's
hidden_states.json too: the layer ids its vLLM server extracted.

Settings: draft_type (the variant's train.draft_type: the checks of that type run, and the
draft must be of it) and num_speculative_tokens (verify's k, which a parallel type's draft must
have been trained to propose). From config.yaml `verify`: reference_draft (a checkpoint dir compared side by side;
differences are reported, they do not fail the contract); serve_render_rows (tokenized rows,
evenly spaced, whose prompts are compared with vLLM's render; null = all). From the tokenized
instance: chat_template_kwargs (rendered as generation and tokenize did) and trust_remote_code.
"""
from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, runtime  # noqa: E402
from pipeline_lib.contract import Context, checks_for, compare_reference, load_draft_config, run_check  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_write_json, read_json  # noqa: E402
from pipeline_lib.provenance import Provenance  # noqa: E402
from pipeline_lib.secrets import scrub_obj  # noqa: E402
from pipeline_lib.target import load_config, load_manifest  # noqa: E402

def main() -> int:
    p = cli.parser(__doc__)
    p.add_argument("--target", required=True, help="target model dir (R/target/model)")
    p.add_argument("--target-manifest", required=True, help="R/target/manifest.json")
    p.add_argument("--draft", required=True, help="draft checkpoint dir (R/drafts/<variant>/final)")
    p.add_argument("--hs-manifest", required=True, help="R/hidden_states/manifest.json")
    p.add_argument("--tokenized-stats", required=True, help="R/tokenized/stats.json")
    p.add_argument("--hs-record", required=True,
                   help="R/drafts/<variant>/hidden_states.json (what training read, and how)")
    p.add_argument("--tokenized-data", required=True, help="R/tokenized/data (the rows the draft trained on)")
    p.add_argument("--traces", required=True, help="R/traces/traces.jsonl (the conversations those rows came from)")
    p.add_argument("--out", required=True, help="contract.json to write")
    args = p.parse_args()
    runtime.setup()
    prov = Provenance("contract_checks", args.settings)

    target = Path(args.target)
    ctx = Context(draft=Path(args.draft), target=target, target_config=load_config(target),
                  target_manifest=load_manifest(args.target_manifest),
                  hs_manifest=read_json(args.hs_manifest, "hidden-states manifest"),
                  stats=read_json(args.tokenized_stats, "tokenized stats"), settings=args.settings,
                  hs_record=read_json(args.hs_record, "training hidden-states record"),
                  tokenized_data=Path(args.tokenized_data), traces=Path(args.traces))
    for what, path in (("tokenized data", ctx.tokenized_data), ("traces", ctx.traces)):
        if not path.exists():
            raise PipelineError(f"{path}: {what} not found; run the tokenize stage (and the traces stage) first")
    if not ctx.draft.is_dir():
        raise PipelineError(f"{ctx.draft}: draft dir not found; run the train_draft rule first")
    load_draft_config(ctx)

    # The checks of the variant's draft type (each family declares the types it applies to).
    checks = [run_check(name, fn, ctx) for name, fn in checks_for(ctx.draft_type)]
    reference = None
    if args.settings.get("reference_draft"):
        ref_checks, reference = compare_reference(ctx, args.settings["reference_draft"])
        checks += ref_checks
    required = [c for c in checks if c.required]
    passed = all(c.passed is True for c in required)
    summary = {"passed": sum(c.passed is True for c in checks), "failed": sum(c.passed is False for c in checks),
               "not_run": sum(c.passed is None for c in checks),
               "failed_required": [c.name for c in required if c.passed is False]}
    record = {"passed": passed, "summary": summary, "draft_type": ctx.draft_type, "checks": [asdict(c) for c in checks],
              "draft": str(args.draft), "target": str(args.target), "reference": reference}
    # Details quote settings and paths as given (a reference_draft URL, say): no credential in them.
    record = scrub_obj(record)
    atomic_write_json(args.out, record)
    prov.write(Path(args.out).with_name(Path(args.out).stem + ".provenance.json"),
               inputs={"target": args.target, "target_manifest": args.target_manifest, "draft": args.draft,
                       "hs_manifest": args.hs_manifest, "tokenized_stats": args.tokenized_stats,
                       "hs_record": args.hs_record, "tokenized_data": args.tokenized_data, "traces": args.traces},
               outputs={"contract": args.out})
    for c in record["checks"]:
        mark = {True: "PASS", False: "FAIL", None: "----"}[c["passed"]]
        print(f"[contract] {mark} {c['name']}{'' if c['required'] else ' (informational)'}"
              f"{': ' + c['detail'] if c['detail'] and c['passed'] is not True else ''}", file=sys.stderr)
    print(f"[contract] {'PASSED' if passed else 'FAILED'}: {summary}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_main(main)
