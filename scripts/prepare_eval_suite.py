#!/usr/bin/env python
"""Rule `eval_suite`: one named eval suite of `verify.suites` as prompt rows, and its overlap
with the draft's training prompts.

Reads the suite's source with the training prompt readers (pipeline_lib.prompts: same formats,
same de-duplication), caps it at `num_samples` (shuffled by `seed`, first N), and writes
prompts.jsonl (row ids "<suite>/<label>:<key>", unique across suites; `suite` on every row).

Overlap: every suite prompt that shares a `ngram`-word n-gram (lower-cased words, the test
prompts_train's decontamination uses) with any user or system turn of R/prompts/train.jsonl is
counted and listed (id, shared n-gram) in overlap.json. A suite declared at training time
(prompts.eval or prompts.decontaminate_with) should show 0; one added later may not - the report
shows the count beside the suite's figures and marks it above verify.overlap_threshold.

    python scripts/prepare_eval_suite.py --settings '{"name": "code", "source": "...", ...}' \\
        --train-prompts R/prompts/train.jsonl --out R/eval_suites/code/prompts.jsonl \\
        --overlap R/eval_suites/code/overlap.json
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, runtime  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_write_json, atomic_write_jsonl, read_jsonl  # noqa: E402
from pipeline_lib.prompts import Decontamination, Prompt, SourceSpec, load_sources, maybe_hub, rows_of  # noqa: E402
from pipeline_lib.prompts.mix import cap  # noqa: E402
from pipeline_lib.provenance import Provenance  # noqa: E402
from pipeline_lib.suite_stats import SUITE_SEP  # noqa: E402

MAX_EXAMPLES = 20


def training_prompts(path: Path) -> list[Prompt]:
    prompts = []
    for lineno, row in read_jsonl(path):
        if not isinstance(row.get("messages"), list):
            raise PipelineError(f"{path}:{lineno}: training prompt row has no 'messages' list; rerun prompts_train")
        prompts.append(Prompt(str(row.get("id", lineno)), row["messages"], row.get("category"), row.get("turns")))
    return prompts


def overlap_record(suite: list[Prompt], train: list[Prompt], n: int) -> dict:
    against = Decontamination.from_prompts(n, train, {"prompts": len(train)})
    hits = [(p, g) for p in suite if (g := against.shared_ngram(p)) is not None]
    return {"ngram": n, "suite_prompts": len(suite), "training_prompts": len(train), "count": len(hits),
            "fraction": round(len(hits) / len(suite), 4) if suite else 0.0,
            "examples": [{"id": p.label, "ngram": " ".join(g)} for p, g in hits[:MAX_EXAMPLES]]}


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--train-prompts", required=True, help="R/prompts/train.jsonl (what the draft trained on)")
    p.add_argument("--out", required=True, help="suite prompts.jsonl to write")
    p.add_argument("--overlap", required=True, help="overlap.json to write")
    args = p.parse_args()
    s = args.settings
    name = s["name"]
    runtime.setup(offline=not maybe_hub(s["source"]))
    prov = Provenance("eval_suite", s)
    spec = SourceSpec.from_entry({k: s.get(k) for k in ("source", "format", "split", "revision", "num_samples")},
                                 f"verify.suites[{s['index']}] ({name})")
    source = load_sources([spec])[0]
    chosen = cap(source.prompts, spec.num_samples, int(s["seed"]), f"suite:{name}")
    if not chosen:
        raise PipelineError(f"{spec.setting}.source = {spec.source}: no usable prompts ({source.counts.loaded} rows "
                            f"loaded, {source.counts.empty_dropped} empty, {source.counts.duplicates_dropped} "
                            f"duplicates); point it at a prompt set")
    rows = rows_of(chosen)
    for row, prompt in zip(rows, chosen):
        row["id"] = f"{name}{SUITE_SEP}{row['id']}"
        row["suite"] = name
        prompt.label = row["id"]  # overlap examples name the measured id
    overlap = overlap_record(chosen, training_prompts(Path(args.train_prompts)), int(s["ngram"]))
    overlap.update(suite=name, declared_at_training=bool(s["declared_at_training"]), input=source.record)
    atomic_write_jsonl(args.out, rows)
    atomic_write_json(args.overlap, overlap)
    prov.write(Path(args.out).with_name("provenance.json"),
               inputs={"train_prompts": args.train_prompts, **({"source": source.record["path"]}
                                                                 if source.record.get("path") else {})},
               outputs={"prompts": args.out, "overlap": args.overlap}, counts={"written": len(rows)})
    print(f"suite {name}: {len(rows)} prompts written to {args.out} ({source.counts.loaded} loaded); "
          f"{overlap['count']} share a {overlap['ngram']}-word n-gram with the {overlap['training_prompts']} "
          f"training prompts", flush=True)


if __name__ == "__main__":
    run_main(main)
