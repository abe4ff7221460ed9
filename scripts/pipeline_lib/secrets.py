"""Credentials never reach what the pipeline writes: logs, provenance, reports.

Two rules. Credentials live in the environment (HF_TOKEN, OPENAI_API_KEY, ...), never in the
config: config values travel on every job's command line, in Snakemake's own log and metadata
(.snakemake/) and in provenance, so the Snakefile refuses a config that holds one
(config_credentials.py). And every text a script writes from outside input (error messages,
tracebacks, the command line, settings in provenance) goes through scrub(), which removes the
values of secret-looking environment variables and anything shaped like a credential.

This module imports nothing of the pipeline's: errors.py scrubs every message through it."""
from __future__ import annotations

import os
import re
from typing import Any

REDACTED = "<redacted>"
# Environment variables whose values are secrets, by name.
SECRET_ENV_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.IGNORECASE)
MIN_SECRET_LEN = 6  # shorter env values are too likely to occur by chance ("1", "true")
# Shapes of credentials: Hugging Face and OpenAI-style keys, `name=value` pairs (also URL query
# parameters) whose name says credential, and bearer tokens.
CREDENTIAL_PATTERN = re.compile(
    r"hf_[A-Za-z0-9]{20,}"
    r"|sk-[A-Za-z0-9_-]{16,}"
    r"|(?i:\b(?:access[_-]?token|auth[_-]?token|token|secret|password|passwd|api[_-]?key|access[_-]?key))[=:]\S+"
    r"|(?i:bearer)\s+[A-Za-z0-9._~+/=-]{8,}")
# A password in a URL's user info: scheme://user:PASSWORD@host
URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]+):[^/\s@]+@")


def secret_env_values() -> list[str]:
    return [v for k, v in os.environ.items() if v and len(v) >= MIN_SECRET_LEN and SECRET_ENV_NAME.search(k)]


def scrub(text: str) -> str:
    """`text` without secret environment values and credential-shaped substrings."""
    for value in secret_env_values():
        text = text.replace(value, REDACTED)
    text = URL_PASSWORD.sub(rf"\1:{REDACTED}@", text)
    return CREDENTIAL_PATTERN.sub(REDACTED, text)


def scrub_obj(obj: Any) -> Any:
    """scrub() applied to every string (keys included) in a JSON-like structure."""
    if isinstance(obj, str):
        return scrub(obj)
    if isinstance(obj, dict):
        return {scrub_obj(k): scrub_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub_obj(v) for v in obj]
    return obj
