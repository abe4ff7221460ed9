"""Prompt sources: which file or hub dataset a setting names, and loading its rows through
`datasets` (chitchat's id-keyed JSON and chatterbot's YAML directly) into Prompts."""
from __future__ import annotations

import itertools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..assets import PREFIX as PYPI_PREFIX, license_note, resolve_asset
from ..errors import PipelineError
from ..io import read_jsonl, read_text
from .formats import AUTO_COLUMNS, FORMATS, Counts, NoUserTurn, Prompt, RawRow, detect_format
from .json_list import JsonListStream

# Gzipped JSON(L) is read by `datasets` as is; YAML is chatterbot-corpus's layout.
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz", ".yml", ".yaml")


def file_suffix(path: Path) -> str:
    """The file type: the longest of FILE_SUFFIXES the name ends with (".jsonl.gz"), else its suffix."""
    return next((s for s in sorted(FILE_SUFFIXES, key=len, reverse=True) if path.name.endswith(s)), path.suffix)


@dataclass
class SourceSpec:
    """One configured prompt source (`prompts.train`, an entry of a `prompts.train` list, or
    `prompts.eval`)."""
    setting: str            # "prompts.train" or "prompts.train[1]", for messages
    source: str
    format: str = "auto"
    split: str = "train"
    revision: str | None = None
    num_samples: int | None = None
    weight: float = 1.0
    answered_only: bool = False  # keep only conversations whose first user turn has the source's answer
    allow_truncated: bool = False  # a JSON list cut off mid-record is read up to its last whole record
    drop_without_user_turn: bool = False  # rows without a user turn are dropped and counted, not an error

    @classmethod
    def from_entry(cls, entry: dict, setting: str) -> "SourceSpec":
        spec = dict(entry or {})
        if not spec.get("source"):
            raise PipelineError(f"{setting}.source is not set; point it at a prompt file or hub dataset")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise PipelineError(f"{setting}.weight = {weight!r}: must be a number > 0")
        flags = {key: spec.get(key, False) for key in ("answered_only", "allow_truncated", "drop_without_user_turn")}
        for key, value in flags.items():
            if not isinstance(value, bool):
                raise PipelineError(f"{setting}.{key} = {value!r}: must be true or false")
        return cls(setting=setting, source=spec["source"], format=spec.get("format") or "auto",
                   split=spec.get("split") or "train", revision=spec.get("revision"),
                   num_samples=spec.get("num_samples"), weight=float(weight), **flags)

    @classmethod
    def all_from_settings(cls, settings: dict, split: str) -> list["SourceSpec"]:
        """The sources of `prompts.<split>`: one mapping, or (train only) a list of them."""
        value = settings.get(split)
        if not isinstance(value, list):
            return [cls.from_entry(value or {}, f"prompts.{split}")]
        if split != "train":
            raise PipelineError(f"prompts.{split} is a list; only prompts.train may be a mix of sources")
        if not value:
            raise PipelineError("prompts.train is an empty list; give at least one source")
        return [cls.from_entry(entry, f"prompts.train[{i}]") for i, entry in enumerate(value)]


# The training source the synthesize stage writes (rules/synthesize.smk): the rules put its
# file's path in the settings as `synthesized_path`.
SYNTHESIZED = "synthesized"


def resolve_synthesized(settings: dict) -> dict:
    """The prompt settings with each training source `synthesized` pointing at the synthesize
    stage's prompt file; an eval source cannot be one (the target's own requests are training data)."""
    path = settings.get("synthesized_path")

    def entries(value: Any, setting: str) -> list[tuple[str, dict]]:
        if isinstance(value, list):
            return [(f"{setting}[{i}]", e) for i, e in enumerate(value) if isinstance(e, dict)]
        return [(setting, value)] if isinstance(value, dict) else []

    for setting, entry in entries(settings.get("eval"), "prompts.eval") + \
            entries(settings.get("decontaminate_with"), "prompts.decontaminate_with"):
        if entry.get("source") == SYNTHESIZED:
            raise PipelineError(f"{setting}.source = {SYNTHESIZED}: the target's own requests are training data "
                                f"(prompts.train); measure on an eval set")
    out = dict(settings)
    train = settings.get("train")
    resolved = []
    for setting, entry in entries(train, "prompts.train"):
        if entry.get("source") == SYNTHESIZED:
            if not path:
                raise PipelineError(f"{setting}.source = {SYNTHESIZED}: the synthesize stage's prompt file is not "
                                    f"known here; build through Snakemake (rule synthesize_gather makes it)")
            entry = {**entry, "source": path}
        resolved.append(entry)
    if resolved:
        out["train"] = resolved if isinstance(train, list) else resolved[0]
    return out


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
        if file_suffix(path) not in FILE_SUFFIXES:
            raise PipelineError(f"{spec.setting}.source = {spec.source}: unsupported file type '{path.suffix}'; "
                                f"use {', '.join(FILE_SUFFIXES)} or a hub dataset id")
        return "file", str(path)
    if path.exists():
        raise PipelineError(f"{spec.setting}.source = {spec.source}: {path} is a directory; point it at a "
                            f"{'/'.join(FILE_SUFFIXES)} file")
    looks_local = file_suffix(path) in FILE_SUFFIXES or spec.source.startswith(("/", ".", "~"))
    if looks_local or spec.source.count("/") != 1:
        raise PipelineError(f"{spec.setting}.source = {spec.source}: prompt file {path} does not exist "
                            f"(nor is it a hub dataset id 'org/name'); fix the path")
    return "hub", spec.source


def source_label(spec: SourceSpec, fmt: str, kind: str) -> str:
    """The `source` of each row and the prefix of its id: stable across machines."""
    if fmt in ("mtbench", "chitchat", "humaneval", "champ"):
        return fmt
    if kind == "hub":
        return spec.source
    path = Path(spec.source[len(PYPI_PREFIX):] if spec.source.startswith(PYPI_PREFIX) else spec.source)
    return path.name[:-len(file_suffix(path))] or path.stem


def iter_chitchat_json(path: Path, data: dict) -> Iterator[RawRow]:
    for conv_id, conv in data.items():
        where = f"{path} conversation {conv_id}"
        if not isinstance(conv, dict):
            raise PipelineError(f"{where}: expected an object with 'messages', got {type(conv).__name__}")
        yield RawRow(str(conv_id), where, conv)


def iter_champ_json(path: Path, data: Any) -> Iterator[RawRow]:
    """CHAMP's v0.json: {"problems": {id: {_text, category, ...}}}; rows are named by problem id."""
    problems = data.get("problems") if isinstance(data, dict) else None
    if not isinstance(problems, dict):
        raise PipelineError(f"{path}: format champ expects CHAMP's v0.json (an object with a 'problems' "
                            f"mapping of id -> problem), got {type(data).__name__}")
    for pid, problem in problems.items():
        where = f"{path} problem {pid}"
        if not isinstance(problem, dict):
            raise PipelineError(f"{where}: expected an object with '_text' and 'category', got "
                                f"{type(problem).__name__}")
        yield RawRow(str(pid), where, problem)


def iter_chatterbot_yaml(path: Path, spec: SourceSpec) -> Iterator[RawRow]:
    """chatterbot-corpus YAML: {categories, conversations: [[user, bot, ...], ...]}; each
    conversation is named by its line (the composed node's mark), so a bad row can be found."""
    import yaml

    text = read_text(path, "prompt file")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise PipelineError(f"{path}{f':{mark.line + 1}' if mark else ''}: not valid YAML "
                            f"({getattr(err, 'problem', None) or err})") from None
    conversations = data.get("conversations") if isinstance(data, dict) else None
    if not isinstance(conversations, list):
        raise PipelineError(f"{path}: expected chatterbot-corpus YAML (a mapping with a 'conversations' list; "
                            f"{spec.setting}.source)")
    nodes = next(v for k, v in root.value if k.value == "conversations").value
    for i, (conv, node) in enumerate(zip(conversations, nodes)):
        yield RawRow(str(i), f"{path}:{node.start_mark.line + 1} (conversation {i})", {"conversation": conv})


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
    read: dict[str, Any] = {}  # filled while the rows are read (a streamed JSON list's counts)
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
            rows, columns, native_format = _load_file(path, spec, cache, read)
        fmt = native_format or (auto_format(columns, spec) if spec.format == "auto" else spec.format)
        if fmt not in FORMATS:
            raise PipelineError(f"{spec.setting}.format = {fmt!r}: choose one of auto, {', '.join(FORMATS)}")
        mapper = FORMATS[fmt]
        prompts = []
        for raw in rows:
            counts.loaded += 1
            try:
                prompt = mapper(raw)
            except NoUserTurn:
                if not spec.drop_without_user_turn:
                    raise
                counts.extra["without_user_turn_dropped"] = counts.extra.get("without_user_turn_dropped", 0) + 1
                continue
            if prompt is None:
                counts.empty_dropped += 1
            else:
                prompts.append(prompt)
    label = source_label(spec, fmt, kind)
    record["format"] = fmt
    record.update(read)
    note = license_note(spec.source)
    if note:
        record["license"] = note
    return label, fmt, prompts, record


def auto_format(columns: list[str], spec: SourceSpec) -> str:
    fmt = detect_format(columns)
    if fmt is None:
        raise PipelineError(f"{spec.setting}.source = {spec.source}: cannot detect the prompt format from its "
                            f"columns {columns}; expected one of {[c for c, _ in AUTO_COLUMNS]}. Set "
                            f"{spec.setting}.format")
    return fmt


def iter_json_list(path: Path, spec: SourceSpec, read: dict[str, Any]) -> tuple[Iterator[RawRow], list[str]]:
    """(rows, the first record's keys) of a JSON list read record by record, cut off or not
    (allow_truncated); `read` receives the counts and the loss at the cut once the rows are read."""
    stream = JsonListStream(path, spec.setting)
    records = iter(stream)
    first = next(records, None)
    if first is None:
        where = "is cut off before its first whole record" if not stream.read.complete else "is an empty list"
        raise PipelineError(f"{path}: the JSON list {where} ({stream.read.file_bytes} bytes); no prompt can be "
                            f"read from it ({spec.setting}.source)")

    def rows() -> Iterator[RawRow]:
        for i, data in enumerate(itertools.chain([first], records)):
            yield RawRow(str(i), f"{path} record {i}", data)
        read["json_list"] = stream.read.loss()

    return rows(), list(first)


def _load_file(path: Path, spec: SourceSpec, cache: str, read: dict[str, Any]):
    """(rows, columns, format if the file's layout implies one) of a local file. JSON is
    checked here first: `datasets` reports a bad line without its line number. The chitchat
    dataset.json (id -> conversation) is no table, so it is read directly; so is a JSON list
    with allow_truncated (record by record, up to the last whole one)."""
    import datasets

    linenos = None
    suffix = file_suffix(path)
    if suffix in (".yml", ".yaml"):
        if spec.format not in ("auto", "chatterbot"):
            raise PipelineError(f"{spec.setting}.format = {spec.format}: {path} is YAML, read as format chatterbot "
                                f"only; set format: chatterbot (or auto)")
        return iter_chatterbot_yaml(path, spec), ["conversation"], "chatterbot"
    if suffix in (".jsonl.gz", ".json.gz"):
        # A JSON list or JSON lines, gzipped (reasoning-gym's codeio-hq.jsonl.gz is a list):
        # the json builder reads both; rows are named by index.
        builder, data_files = "json", str(path)
    elif suffix == ".jsonl":
        linenos = [lineno for lineno, _ in read_jsonl(path)]
        if not linenos:
            raise PipelineError(f"{path}: the prompt file is empty ({spec.setting}.source)")
        builder, data_files = "json", str(path)
    elif suffix == ".json" and spec.allow_truncated:
        rows, columns = iter_json_list(path, spec, read)
        return rows, columns, None
    elif suffix == ".json":
        text = read_text(path, "prompt file")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            cut = (f"; the file ends mid-document (cut off?): {spec.setting}.allow_truncated: true reads a JSON "
                   f"list up to its last whole record and reports the loss"
                   if err.pos >= len(text.rstrip()) - 16 or err.msg.startswith("Unterminated string") else "")
            raise PipelineError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno}){cut}") from None
        if spec.format == "champ":
            return iter_champ_json(path, data), ["_text", "category"], "champ"
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


def maybe_hub(source: str) -> bool:
    return bool(source) and not source.startswith(PYPI_PREFIX) and not Path(source).exists() \
        and source.count("/") == 1 and file_suffix(Path(source)) not in FILE_SUFFIXES

