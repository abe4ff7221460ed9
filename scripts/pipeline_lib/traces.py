"""The trace row format (docs/artifacts.md) and how a conversation's earlier turns become the
context of a later one.

The context is shared by the traces stage (the request each user turn sends to the target) and tokenize (the
prompt part it renders for that turn), so both see exactly the same messages. An earlier
answer goes back as the assistant's `content`; its reasoning travels in the fields vLLM hands
to chat templates (`reasoning`, and `reasoning_content`, which vLLM sets to the same text), so
the target's own chat template decides whether past reasoning is rendered or dropped.
"""
from __future__ import annotations

from collections import Counter
from typing import Any


def assistant_message(answer: str | None, reasoning: str | None) -> dict[str, Any]:
    """An earlier answer as a context message."""
    message: dict[str, Any] = {"role": "assistant", "content": answer or ""}
    if reasoning:
        message["reasoning"] = reasoning
        message["reasoning_content"] = reasoning
    return message


def turn_messages(opening: list[dict[str, Any]], earlier: list[tuple[str | None, str | None]],
                  later_users: list[str]) -> list[dict[str, Any]]:
    """The messages of turn len(earlier) + 1: the opening (system messages and the first user
    turn), then each earlier (answer, reasoning) followed by the next user turn."""
    if len(earlier) > len(later_users):
        raise ValueError(f"{len(earlier)} earlier answers but only {len(later_users)} later user turns")
    messages = list(opening)
    for (answer, reasoning), user in zip(earlier, later_users):
        messages.append(assistant_message(answer, reasoning))
        messages.append({"role": "user", "content": user})
    return messages


# ---------------------------------------------------------------------------- trace rows

FINISH_REASONS = ("stop", "length", "error")
# What one answered (or failed) user turn records: the first turn's fields sit at the top of
# the trace row, later turns under `later_turns` (each also with its `user` text).
TURN_FIELDS = ("reasoning", "answer", "finish_reason", "error", "prompt_tokens", "completion_tokens", "token_ids")
ROW_FIELDS = ("id", "messages", *TURN_FIELDS, "later_turns", "turns_total", "turns_dropped", "sampling", "backend",
              "category")


def row_turns(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Every turn record of a trace row, the first one (the row itself) included."""
    return [row, *row.get("later_turns", [])]


def count_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over trace rows; `ok`/`failed`/`truncated` count conversations by their first
    turn, `turns_*` count user turns (answered + failed + dropped = total), `failed_by_error`
    the failed turns by the class of their error."""
    from .generation import error_label

    turns = [t for r in rows for t in row_turns(r)]
    return {"rows": len(rows),
            "ok": sum(r["finish_reason"] != "error" for r in rows),
            "failed": sum(r["finish_reason"] == "error" for r in rows),
            "truncated": sum(r["finish_reason"] == "length" for r in rows),
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
            "completion_tokens": sum(t["completion_tokens"] for t in turns),
            "turns_total": sum(r["turns_total"] for r in rows),
            "turns_answered": sum(t["finish_reason"] != "error" for t in turns),
            "turns_failed": sum(t["finish_reason"] == "error" for t in turns),
            "turns_dropped": sum(r["turns_dropped"] for r in rows),
            "rows_with_dropped_turns": sum(r["turns_dropped"] > 0 for r in rows),
            "turns_with_token_ids": sum(t["token_ids"] is not None for t in turns),
            "failed_by_error": dict(sorted(Counter(error_label(t["error"]) for t in turns
                                                   if t["finish_reason"] == "error").items()))}
