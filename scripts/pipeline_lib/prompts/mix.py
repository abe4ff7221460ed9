"""A split's prompts: de-duplication, the train/eval split, caps, the weighted mix of several
training sources, decontamination against the eval source, and the rows written."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from ..errors import PipelineError
from .decontamination import Decontamination
from .formats import EVAL_ONLY_FORMATS, Counts, Prompt
from .sources import SourceSpec, load_prompts

# ---------------------------------------------------------------------------------------
# Dedup, split, cap, mix
# ---------------------------------------------------------------------------------------

def prompt_key(p: Prompt) -> str:
    """What makes two prompts duplicates: the opening (system + first user turn), the request
    `generation.turns: first` sends, so no prompt is ever answered and trained on twice."""
    return json.dumps(p.messages, sort_keys=True, ensure_ascii=False)


def dedupe(prompts: list[Prompt], counts: Counts, seen: dict[str, str] | None = None,
           label: str = "") -> list[Prompt]:
    """Drop exact duplicates (same messages); the first occurrence in source order stays.
    `seen` (key -> label) carries the keys of sources loaded before: a prompt already in an
    earlier source of a mix is counted as `duplicates_across_sources`."""
    seen = {} if seen is None else seen
    out = []
    for p in prompts:
        key = prompt_key(p)
        if key in seen:
            if seen[key] == label:
                counts.duplicates_dropped += 1
            else:
                counts.extra["duplicates_across_sources"] = counts.extra.get("duplicates_across_sources", 0) + 1
            continue
        seen[key] = label
        out.append(p)
    return out


def holdout(prompts: list[Prompt], fraction: float, seed: int, tag: str = "") -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval): eval = `fraction` of the rows chosen by seed, train = exactly the rest."""
    if len(prompts) < 2:
        raise PipelineError(f"prompts.eval_fraction: the training source has {len(prompts)} usable prompt(s); "
                            f"holding out an eval set needs at least 2. Set prompts.eval.source instead")
    n_eval = min(len(prompts) - 1, max(1, round(len(prompts) * fraction)))
    order = list(range(len(prompts)))
    random.Random(f"{seed}:holdout{tag}").shuffle(order)
    eval_idx = set(order[:n_eval])
    return ([p for i, p in enumerate(prompts) if i not in eval_idx],
            [p for i, p in enumerate(prompts) if i in eval_idx])


def cap(prompts: list[Prompt], num_samples: int | None, seed: int, split: str, tag: str = "") -> list[Prompt]:
    """Shuffle by seed, take the first num_samples (all when null). The shuffled order is kept:
    later stages take prefixes (validation split, verify.num_prompts) and should see a mix."""
    shuffled = list(prompts)
    random.Random(f"{seed}:{split}:cap{tag}").shuffle(shuffled)
    if num_samples is not None and num_samples > len(shuffled):
        print(f"note: prompts.{split}.num_samples = {num_samples} but only {len(shuffled)} prompts are "
              f"available{' from ' + tag[1:] if tag else ''}; using all of them", flush=True)
    return shuffled if num_samples is None else shuffled[:num_samples]


def eval_held_out(settings: dict) -> bool:
    """True when the eval set comes out of the training source (prompts.eval.source null).
    The rules pass `eval_held_out` (and only the sections a split depends on); a full
    `prompts` section works too."""
    if "eval_held_out" in settings:
        return bool(settings["eval_held_out"])
    return not (settings.get("eval") or {}).get("source")


def split_specs(settings: dict, split: str) -> list[SourceSpec]:
    """The source(s) a split is loaded from: its own, or the training sources when held out."""
    held_out = eval_held_out(settings)
    specs = SourceSpec.all_from_settings(settings, "train" if split == "train" or held_out else "eval")
    if split == "train" or held_out:
        for spec in specs:
            if spec.format in EVAL_ONLY_FORMATS:
                raise PipelineError(f"{spec.setting}.format = {spec.format}: a benchmark, measured and never "
                                    f"trained on; list it under verify.suites (or prompts.eval), not in "
                                    f"prompts.train")
    return specs


HELD_OUT_CATEGORY = "held-out"


def split_tail(prompts: list[Prompt], n: int, seed: int, tag: str = "",
               setting: str = "prompts.eval_held_out_samples") -> tuple[list[Prompt], list[Prompt]]:
    """(rest, held): the last n of the training split's own seeded order are held out, so the
    first num_samples (what cap() keeps) do not change while the source has spare rows."""
    if n >= len(prompts) and n:
        share = f"{setting}: {n} of them from {tag[1:]}" if tag else f"{setting} = {n}"
        raise PipelineError(f"{share}: the training source has only {len(prompts)} usable prompt(s) and "
                            f"training needs some; lower it")
    order = cap(prompts, None, seed, "train", tag)
    return (order[:-n], order[-n:]) if n else (order, [])


@dataclass
class Source:
    """One loaded source of a split: its prompts (de-duplicated, in source order) and counts."""
    spec: SourceSpec
    label: str
    format: str
    prompts: list[Prompt]
    record: dict[str, Any]
    counts: Counts
    tag: str  # seed suffix: "" for a lone source (its rows as before mixes existed), ":label" in a mix


def decontamination_for(settings: dict) -> Decontamination | None:
    """None when off (decontamination_ngram 0) or when eval rows come out of the training
    source itself (eval.source null: exact duplicates are already dropped before the split)."""
    n = int(settings.get("decontamination_ngram", 0) or 0)
    if n <= 0 or eval_held_out(settings):
        return None
    evals = load_sources(SourceSpec.all_from_settings(settings, "eval"))
    against: dict[str, Any] = {**evals[0].record, "loaded": evals[0].counts.loaded}
    # Further benchmarks declared at training time (prompts.decontaminate_with), e.g. the
    # verify.suites the draft will be measured on.
    further = [SourceSpec.from_entry(e, f"prompts.decontaminate_with[{i}]")
               for i, e in enumerate(settings.get("decontaminate_with") or [])]
    if further:
        more = [load_sources([spec])[0] for spec in further]  # one at a time: labels may repeat across them
        evals += more
        against["further"] = [{**s.record, "loaded": s.counts.loaded} for s in more]
    return Decontamination.from_prompts(n, [p for s in evals for p in s.prompts], against)


def load_sources(specs: list[SourceSpec], decontamination: Decontamination | None = None) -> list[Source]:
    seen: dict[str, str] = {}
    sources: list[Source] = []
    for spec in specs:
        counts = Counts()
        label, fmt, prompts, record = load_prompts(spec, counts)
        clash = next((s for s in sources if s.label == label), None)
        if clash:
            raise PipelineError(f"{spec.setting}.source = {spec.source} and {clash.spec.setting}.source = "
                                f"{clash.spec.source} have the same label {label!r} (row ids are label:key, so "
                                f"they would collide); merge them into one file or rename one")
        for p in prompts:
            p.label = label
        if spec.answered_only:
            # Before de-duplication: of two conversations with one opening, the answered one stays.
            kept = [p for p in prompts if p.turns and p.turns[0]["assistant"] is not None]
            counts.extra["unanswered_dropped"] = len(prompts) - len(kept)
            prompts = kept
        if decontamination:
            prompts = decontamination.filter(prompts, counts)
        prompts = dedupe(prompts, counts, seen, label)
        sources.append(Source(spec, label, fmt, prompts, {**record, "label": label}, counts,
                              "" if len(specs) == 1 else f":{label}"))
    return sources


def held_out_shares(n: int, sources: list[Source]) -> list[int]:
    """n split over the sources in proportion to their weights (largest remainder)."""
    total = sum(s.spec.weight for s in sources)
    exact = [n * s.spec.weight / total for s in sources]
    shares = [int(x) for x in exact]
    for i in sorted(range(len(sources)), key=lambda i: exact[i] - shares[i], reverse=True)[:n - sum(shares)]:
        shares[i] += 1
    return shares


def interleave(parts: list[list[Prompt]], weights: list[float], seed: int) -> list[Prompt]:
    """The mix's order: a seeded draw from the sources weighted by `weight`, every row exactly
    once (datasets.interleave_datasets, all_exhausted_without_replacement)."""
    nonempty = [(rows, w) for rows, w in zip(parts, weights) if rows]
    if len(nonempty) <= 1:
        return [p for rows, _ in nonempty for p in rows]
    import datasets

    datasets.disable_progress_bars()
    tables = [datasets.Dataset.from_dict({"part": [i] * len(rows), "row": list(range(len(rows)))})
              for i, (rows, _) in enumerate(nonempty)]
    total = sum(w for _, w in nonempty)
    mixed = datasets.interleave_datasets(tables, probabilities=[w / total for _, w in nonempty], seed=seed,
                                         stopping_strategy="all_exhausted_without_replacement")
    return [nonempty[i][0][j] for i, j in zip(mixed["part"], mixed["row"])]


def rows_of(prompts: list[Prompt], category: str | None = None, with_turns: bool = False) -> list[dict]:
    """Prompt rows (docs/artifacts.md). `turns` only on training rows: acceptance measures first turns."""
    rows = []
    for p in prompts:
        row = {"id": f"{p.label}:{p.key}", "messages": p.messages, "category": category or p.category,
               "source": p.label}
        if with_turns and p.turns:
            row["turns"] = p.turns
        rows.append(row)
    return rows


def source_summary(s: Source, selected: list[Prompt]) -> dict[str, Any]:
    ids = {id(p) for p in selected}
    return {"setting": s.spec.setting, **s.record, "weight": s.spec.weight, "num_samples": s.spec.num_samples,
            "loaded": s.counts.loaded, "empty_dropped": s.counts.empty_dropped,
            "duplicates_dropped": s.counts.duplicates_dropped, **s.counts.extra,
            "with_later_turns": sum(bool(p.turns) and len(p.turns) > 1 for p in s.prompts),
            "with_answers": sum(bool(p.turns) and p.turns[0]["assistant"] is not None for p in s.prompts),
            "selected": sum(id(p) in ids for p in s.prompts)}


def build_split(settings: dict, split: str) -> tuple[list[dict], dict[str, Any]]:
    seed = int(settings.get("seed", 0))
    held_out = eval_held_out(settings)
    add_held = 0 if held_out else int(settings.get("eval_held_out_samples") or 0)
    # Training rows (and the held-out ones the eval split takes from them) are decontaminated.
    decontamination = decontamination_for(settings) if split == "train" or add_held else None
    sources = load_sources(split_specs(settings, split), decontamination if split == "train" else None)
    if held_out:
        fraction = float(settings.get("eval_fraction", 0.1))
        for s in sources:
            train, evals = holdout(s.prompts, fraction, seed, s.tag)
            s.counts.extra["held_out_for_eval"] = len(evals)
            s.prompts = train if split == "train" else evals
    elif add_held and split == "train":
        for s, n in zip(sources, held_out_shares(add_held, sources)):
            s.prompts, held = split_tail(s.prompts, n, seed, s.tag)  # the rest, in the seeded order
            s.counts.extra["held_out_for_eval"] = len(held)
    for s in sources:
        s.counts.extra["available"] = len(s.prompts)
    if split == "train":
        # Already in the seeded order when held-out rows were taken from its tail.
        parts = [s.prompts[:s.spec.num_samples] if add_held else cap(s.prompts, s.spec.num_samples, seed, split, s.tag)
                 for s in sources]
        chosen = interleave(parts, [s.spec.weight for s in sources], seed)
        total = settings.get("mix_num_samples")
        if total is not None and total < len(chosen):
            chosen = chosen[:total]
    else:
        pool = [p for s in sources for p in s.prompts]
        chosen = cap(pool, (settings.get(split) or {}).get("num_samples"), seed, split)
    if not chosen:
        def why(s: Source) -> str:
            return (f"{s.counts.loaded} rows loaded, {s.counts.empty_dropped} empty, "
                    f"{s.counts.duplicates_dropped} duplicates"
                    + (f", {s.counts.extra.get('without_user_turn_dropped', 0)} without a user turn"
                       if s.spec.drop_without_user_turn else "")
                    + (f", {s.counts.extra.get('unanswered_dropped', 0)} without an answer (answered_only)"
                       if s.spec.answered_only else "")
                    + (f", {s.counts.extra['contaminated_dropped']} sharing an n-gram with the eval set"
                       if "contaminated_dropped" in s.counts.extra else "")
                    + (f", {s.counts.extra.get('duplicates_across_sources', 0)} already in an earlier source"
                       if len(sources) > 1 else "")
                    + (f", {s.counts.extra.get('held_out_for_eval', 0)} held out for eval" if held_out else ""))

        where = "; ".join(f"{s.spec.setting}.source = {s.spec.source}" for s in sources)
        raise PipelineError(f"{where}: the {split} prompt set is empty after filtering ("
                            + "; ".join(why(s) for s in sources) + "); point it at a larger prompt set")
    rows = rows_of(chosen, with_turns=split == "train")
    per_source = [source_summary(s, chosen) for s in sources]
    record: Any = sources[0].record if len(sources) == 1 else [s.record for s in sources]
    if add_held and split == "eval":
        # The same held-out rows the train split excluded, mixed in so that prefixes
        # (verify.num_prompts, concurrency_one_prompts) see both kinds.
        train_sources = load_sources(SourceSpec.all_from_settings(settings, "train"), decontamination)
        held = [p for s, n in zip(train_sources, held_out_shares(add_held, train_sources))
                for p in split_tail(s.prompts, n, seed, s.tag)[1]]
        rows += rows_of(held, HELD_OUT_CATEGORY)
        random.Random(f"{seed}:eval:mix").shuffle(rows)
        record = {**record, "held_out_from": train_sources[0].record} if len(train_sources) == 1 \
            else {"eval": record, "held_out_from": [s.record for s in train_sources]}
        per_source[0]["held_out_added"] = len(held)
    totals = {k: sum(src.get(k, 0) for src in per_source)
              for k in ("loaded", "empty_dropped", "duplicates_dropped")}
    extra = {k: sum(src.get(k, 0) for src in per_source)
             for k in ("without_user_turn_dropped", "unanswered_dropped", "contaminated_dropped", "duplicates_across_sources",
                       "held_out_for_eval", "available", "held_out_added")
             if any(k in src for src in per_source)}
    fmt = sources[0].format if len(sources) == 1 else [s.format for s in sources]
    label = sources[0].label if len(sources) == 1 else [s.label for s in sources]
    summary = {"split": split, "format": fmt, "label": label, "held_out": held_out, "input": record,
               **totals, **extra, "written": len(rows), "sources": per_source,
               "decontamination": decontamination.summary() if decontamination else None}
    if split == "train":
        summary["with_later_turns"] = sum("turns" in r and len(r["turns"]) > 1 for r in rows)
        summary["with_answers"] = sum("turns" in r and r["turns"][0]["assistant"] is not None for r in rows)
    return rows, summary


def input_files(summary: dict) -> dict[str, str]:
    """Provenance inputs: each local source file (`source`, or `source_<i>` in a mix)."""
    def files(record: Any, name: str) -> dict[str, str]:
        if isinstance(record, list):
            return {f"{name}_{i}": r["path"] for i, r in enumerate(record) if r.get("path")}
        return {name: record["path"]} if record.get("path") else {}

    record = summary["input"]
    against = files(summary["decontamination"]["against"], "decontamination_source") \
        if summary.get("decontamination") else {}
    if isinstance(record, dict) and "held_out_from" in record:
        own = record.get("eval", {k: v for k, v in record.items() if k != "held_out_from"})
        return {**files(own, "source"), **files(record["held_out_from"], "held_out_source"), **against}
    return {**files(record, "source"), **against}

