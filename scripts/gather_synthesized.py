#!/usr/bin/env python
"""Stage synthesize, gather: the shards' candidate requests, filtered and decontaminated, as
a prompt file the training mix reads (`source: synthesized` in prompts.train).

    gather_synthesized.py --settings JSON --shards S/0-of-N.jsonl ... --out synthesized.jsonl \\
        --summary summary.json --provenance provenance.json

The candidates are taken in index order (so the result does not depend on num_shards) through
the filters of pipeline_lib/synthesis/filters.py, in this order: failed, unfinished,
template_markers, length, language (a cheap ASCII/letter-share heuristic, not language
identification), refusal, duplicate (word n-gram overlap with an earlier kept request) and
contaminated (an n-gram shared with any prompt of every eval suite: `suites` = prompts.eval,
prompts.decontaminate_with and verify.suites, each read whole). summary.json counts what each
filter dropped, with examples; candidates = written + the drops.

Rows: {"id": "synth-<index>", "messages": [{"role": "user", "content": request}], "category":
topic name or null}: the request alone, without the steering system prompt, so the traces
stage answers it as any user's.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, parallel, runtime  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_write_json, atomic_write_jsonl, read_jsonl  # noqa: E402
from pipeline_lib.provenance import Provenance  # noqa: E402
from pipeline_lib.shards import read_shard_summary, shard_index  # noqa: E402

ROW_FIELDS = ("index", "id", "topic", "text", "finish_reason", "error", "special_tokens_emitted")


def read_candidates(path: Path) -> list[dict]:
    rows = []
    for lineno, row in read_jsonl(path):
        absent = [k for k in ROW_FIELDS if k not in row]
        if absent or not isinstance(row.get("text"), str):
            raise PipelineError(f"{path}:{lineno}: candidate row lacks {absent or ['text as a string']}; regenerate "
                                f"this shard")
        rows.append(row)
    return rows


def eval_suites(entries: list[dict], n: int):
    """The n-gram test against every eval suite, each read whole (not capped)."""
    from pipeline_lib.prompts import Decontamination, SourceSpec, load_sources

    loaded = []
    for entry in entries:
        spec = SourceSpec.from_entry({k: entry.get(k) for k in ("source", "format", "split", "revision")},
                                     entry["setting"])
        loaded.append(load_sources([spec])[0])  # one at a time: labels may repeat across suites
    against = [{"setting": s.spec.setting, **s.record, "loaded": s.counts.loaded} for s in loaded]
    return Decontamination.from_prompts(n, [p for s in loaded for p in s.prompts], {"suites": against})


def main() -> int:
    p = cli.parser(__doc__)
    p.add_argument("--shards", required=True, nargs="+", type=Path, help="all shard files <i>-of-<n>.jsonl")
    p.add_argument("--out", required=True, type=Path, help="synthesized.jsonl (prompt rows)")
    p.add_argument("--summary", required=True, type=Path, help="summary.json (counts per filter)")
    p.add_argument("--provenance", required=True, type=Path, help="provenance.json")
    args = p.parse_args()
    settings = args.settings
    from pipeline_lib.prompts import maybe_hub
    from pipeline_lib.synthesis import FILTERS, FilterContext, apply_filters

    suites = settings.get("suites") or []
    runtime.setup(offline=not any(maybe_hub(e["source"]) for e in suites))
    prov = Provenance("synthesize_gather", settings)
    index = shard_index(args.shards)
    n = len(index)
    paths = [index[i] for i in range(n)]
    shards = [read_candidates(path) for path in paths]
    summaries = [read_shard_summary(path, i, n, len(rows)) for i, (path, rows) in enumerate(zip(paths, shards))]
    if len({s.get("generation_key") for s in summaries}) != 1:
        raise PipelineError("the shards were generated with different settings; rerun the synthesize stage so "
                            "that all shards share one configuration")
    candidates = sorted((r for rows in shards for r in rows), key=lambda r: r["index"])
    indices = [r["index"] for r in candidates]
    if indices != list(range(len(candidates))):
        raise PipelineError(f"the shards' candidates are not indices 0..{len(candidates) - 1} exactly once; "
                            f"regenerate the shards")

    filters = settings.get("filters") or {}
    ngram = int(filters.get("decontamination_ngram", 8))
    decontamination = eval_suites(suites, ngram) if suites else None
    markers = sorted({m for s in summaries for m in s.get("template_markers") or []})
    ctx = FilterContext.from_settings(filters, markers, decontamination)
    kept, report = apply_filters(candidates, ctx)
    counts = {name: report[name]["dropped"] for name in FILTERS}
    if not kept:
        raise PipelineError(f"no synthesized request passed the filters ({len(candidates)} candidates; dropped: "
                            + ", ".join(f"{k} {v}" for k, v in counts.items())
                            + "); ask for more (synthesize.num_prompts) or loosen synthesize.filters")
    rows = [{"id": c["id"], "messages": [{"role": "user", "content": c["text"]}], "category": c["topic"]}
            for c in kept]
    atomic_write_jsonl(args.out, rows)
    topics = sorted({c["topic"] for c in candidates if c["topic"]})
    summary = {
        "candidates": len(candidates), "written": len(rows), "dropped": counts, "filters": report,
        "order": list(FILTERS),
        "by_topic": {t: {"candidates": sum(c["topic"] == t for c in candidates),
                         "written": sum(c["topic"] == t for c in kept)} for t in topics},
        "decontamination": ({"ngram": ngram, **decontamination.summary()} if decontamination else None),
        "language_filter": "heuristic: letter share of non-space characters and ASCII share of letters "
                           "(English-leaning), not language identification",
        "num_shards": n, "reused": sum(s.get("reused", 0) for s in summaries),
        "generated": sum(s.get("generated", 0) for s in summaries),
        "wall_s": round(sum(s.get("wall_s", 0.0) for s in summaries), 3),
        "generation": {k: summaries[0].get(k) for k in ("settings", "backend", "generation_key", "prompt_prefixes")},
    }
    atomic_write_json(args.summary, summary)
    inputs = {f"shard_{i}": path for i, path in enumerate(paths)}
    if decontamination:
        inputs.update({f"suite_{i}": s["path"] for i, s in enumerate(decontamination.against["suites"])
                       if s.get("path")})
    prov.write(args.provenance, inputs=inputs, outputs={"prompts": args.out, "summary": args.summary},
               counts={"candidates": len(candidates), "written": len(rows), "dropped": counts},
               generation_key=summaries[0].get("generation_key"), parallel=parallel.of_shards(summaries))
    print(f"[synthesize gather] {len(rows)} of {len(candidates)} candidate requests kept -> {args.out}; dropped: "
          + ", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
    return 0


if __name__ == "__main__":
    run_main(main)
