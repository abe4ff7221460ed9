"""The argument parser every script starts from: `--settings` carries the config section
that defines the stage (as JSON, from the Snakefile's params), so scripts also run by hand."""
from __future__ import annotations

import argparse
import json
from typing import Any

from .errors import PipelineError
from .io import read_text


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="{}", type=json_object,
                   help="JSON object with this stage's config section (see config.yaml); "
                        "'@file.json' reads it from a file")
    return p


def json_object(text: str) -> dict[str, Any]:
    """argparse type: a JSON object, inline or '@file.json'."""
    if text.startswith("@"):
        try:
            text = read_text(text[1:], "--settings file")
        except PipelineError as err:
            raise argparse.ArgumentTypeError(str(err))
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON: {err}")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def require(settings: dict, key: str, section: str) -> Any:
    if key not in settings:
        raise PipelineError(f"setting {section}.{key} is missing; set it in config.yaml")
    return settings[key]


def reject_unknown_keys(settings: dict, known: set[str], section: str) -> None:
    """A settings mapping with a key the stage does not know (a typo) is an error naming it."""
    unknown = sorted(set(settings) - known)
    if unknown:
        raise PipelineError(f"{section} settings: unknown key(s) {unknown}; known keys: {sorted(known)}")
