"""The target's chat template rendered up to the opening of a user turn (Magpie): what follows
is the user's request, so a chat model completes it by writing one, up to its end of turn."""
from __future__ import annotations

from typing import Any

from ..errors import PipelineError

# Stands in for the user's text while rendering; the prefix is everything before it.
SENTINEL = "\uE000USER-REQUEST\uE000"


def user_turn_prefix(tokenizer: Any, system_prompt: str | None,
                     chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """(text, token ids) of the template rendered with [system prompt?, a user turn] and cut
    where the user's text would start. No system prompt renders the template's own default
    (e.g. SmolLM2's), as a conversation without one would."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) \
        + [{"role": "user", "content": SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                             **(chat_template_kwargs or {}))
    except Exception as err:  # jinja errors of a template that refuses these messages
        raise PipelineError(f"the target's chat template cannot render a conversation with a user turn: "
                            f"{type(err).__name__}: {err}") from None
    if not isinstance(text, str) or SENTINEL not in text:
        raise PipelineError("the target's chat template does not render the user's text as given, so the "
                            "opening of a user turn cannot be found; the synthesize stage needs a chat template "
                            "that places the user message verbatim")
    prefix = text[:text.index(SENTINEL)]
    return prefix, tokenizer(prefix, add_special_tokens=False)["input_ids"]


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens (role markers, end of turn, ...)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if tok.special)
    return ids


def template_markers(tokenizer: Any) -> list[str]:
    """The special tokens' text: a request spelling one out (as plain tokens) carries template markup."""
    return sorted({tokenizer.convert_ids_to_tokens(i) for i in special_token_ids(tokenizer)} - {None, ""})
