"""A config that holds a credential is refused before anything runs: config values travel on
every job's command line, in Snakemake's own log and metadata (.snakemake/) and in provenance,
so credentials must come from the environment (secrets.py has the redaction rules)."""
from __future__ import annotations

from typing import Any, Iterator

from .errors import PipelineError
from .secrets import scrub


def _strings(obj: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(obj, str):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _strings(v, f"{path}[{i}]")


def credential_settings(config: dict) -> list[str]:
    """Dotted names of the settings whose value holds a credential (never the values)."""
    return [path for path, value in _strings(config) if scrub(value) != value]


def refuse_credentials_in_config(config: dict) -> None:
    found = credential_settings(config)
    if found:
        raise PipelineError(
            f"config setting(s) {', '.join(found)} hold a credential (a token, key, password or URL "
            f"password). Config values are written to every job's command line, Snakemake's log and "
            f"metadata (.snakemake/) and provenance.json, so credentials must come from the "
            f"environment instead: OPENAI_API_KEY for generation.endpoint, HF_TOKEN for the hub. "
            f"Remove the credential from the setting (the value is not repeated here)")
