"""The data-scaling curve: train.max_conversations trains a draft on a nested subset of the
run's conversations (pipeline_lib/training/subset.py), variants at several sizes share every
upstream stage instance, and the comparison shows tau against the number of conversations
with the gain per added conversation of the last step (pipeline_lib/report/scaling.py).

The subsets are built from the real hidden states of test_train's `hs_run` (24 chitchat rows,
extracted from the tiny target); two of its conversations are written as several rows, as the
tokenize stage writes a conversation whose template re-renders an earlier answer."""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import pytest

from conftest import run_script, run_snakemake, with_defaults
from pipeline_lib import stages
from pipeline_lib.errors import PipelineError
from pipeline_lib.suite_stats import paired_difference, suite_figures
from pipeline_lib.training.settings import TrainSettings
from pipeline_lib.training.subset import SUBSET_DIR, SUBSET_ROWS, conversations, training_data
from test_train import ROWS, SETTINGS, hs_run, train_args  # noqa: F401  (hs_run: the module fixture)
from test_workflow import planned_jobs

# Row ids as tokenize writes them: conversation c3 is rows 3-4, c10 is rows 10-12.
ROW_IDS = [f"c{i}" for i in range(ROWS)]
ROW_IDS[4], ROW_IDS[11], ROW_IDS[12] = "c3#2", "c10#2", "c10#3"
CONVERSATIONS = ROWS - 3


@pytest.fixture(scope="module")
def stats(hs_run) -> Path:
    path = hs_run["root"] / "tokenized" / "stats.json"
    path.write_text(json.dumps({"rows": ROWS, "row_ids": ROW_IDS}))
    return path


def source_rows(hs_run) -> list[dict]:
    from datasets import load_from_disk

    return list(load_from_disk(str(hs_run["data"])).with_format(None))


def subset(hs_run, stats, n, out: Path, seed: int = 0):
    settings = TrainSettings.from_dict({**SETTINGS, "seed": seed, "max_conversations": n})
    return training_data(hs_run["data"], hs_run["data"] / "token_freq.pt", stats, settings,
                         out / SUBSET_DIR, with_hidden_states=True).materialize()


def test_conversations_group_a_conversations_rows():
    groups = conversations(ROW_IDS)
    assert len(groups) == CONVERSATIONS
    assert [3, 4] in groups and [10, 11, 12] in groups and [5] in groups
    # An id that merely ends in #<k> after another conversation starts its own.
    assert conversations(["a", "b#2", "b"]) == [[0], [1], [2]]


def test_sizes_train_on_nested_subsets_with_their_rows_and_counts(hs_run, stats, tmp_path):
    """Three sizes with one seed: each subset's rows are in every larger one, a conversation's
    rows stay together, the view holds exactly those rows (their tokens, their hidden-state
    files by new position) and token counts over them, and the record says so."""
    import torch
    from datasets import load_from_disk

    src = source_rows(hs_run)
    groups = {i: g for g in conversations(ROW_IDS) for i in g}
    used = {n: subset(hs_run, stats, n, tmp_path / f"n{n}") for n in (5, 10, 15)}
    picked = {n: json.loads((u.data / SUBSET_ROWS).read_text())["rows"] for n, u in used.items()}
    assert set(picked[5]) < set(picked[10]) < set(picked[15])
    for n, u in used.items():
        rows = picked[n]
        assert rows == u.rows == sorted(rows)  # dataset order: speculators' last rows validate
        assert all(set(groups[i]) <= set(rows) for i in rows)
        assert len({tuple(groups[i]) for i in rows}) == n
        view = load_from_disk(str(u.data))
        assert view.format["type"] == "torch" and view.features["input_ids"].feature.dtype == "int64"
        view_rows = list(view.with_format(None))
        assert [r["input_ids"] for r in view_rows] == [src[i]["input_ids"] for i in rows]
        for j, i in enumerate(rows):
            assert os.path.samefile(u.data / "hidden_states" / f"hs_{j}.safetensors",
                                    hs_run["data"] / "hidden_states" / f"hs_{i}.safetensors")
        assert len(list((u.data / "hidden_states").iterdir())) == len(rows)
        freq = Counter(t for i in rows for t, m in zip(src[i]["input_ids"], src[i]["loss_mask"]) if m)
        assert torch.load(u.token_freq, weights_only=True) == dict(freq)
        train_rows = int(len(rows) * SETTINGS["train_data_ratio"])
        assert u.record == {**u.record, "conversations": n, "of_conversations": CONVERSATIONS, "rows": len(rows),
                            "train_rows": train_rows, "tokens": sum(src[i]["seq_len"] for i in rows),
                            "train_tokens": sum(src[i]["seq_len"] for i in rows[:train_rows]),
                            "loss_tokens": sum(freq.values())}
        assert u.record["subset"]["seed"] == 0 and f"first {n} conversations" in u.record["subset"]["definition"]
    # Another seed draws another subset; all conversations is the whole data dir, not a view.
    assert subset(hs_run, stats, 10, tmp_path / "seed1", seed=1).rows != picked[10]
    whole = subset(hs_run, stats, CONVERSATIONS, tmp_path / "all")
    assert whole.data == hs_run["data"] and whole.rows == list(range(ROWS))
    assert not (tmp_path / "all" / SUBSET_DIR).exists()


@pytest.mark.parametrize("n, needle", [
    (CONVERSATIONS + 1, f"setting train.max_conversations = {CONVERSATIONS + 1} is larger than this run's training "
                        f"data: {CONVERSATIONS} conversations ({ROWS} rows"),
    (1, "setting train.max_conversations = 1 gives 1 rows, and train_data_ratio = 0.85 splits them into 0 training"),
])
def test_a_size_the_run_cannot_give_is_refused(hs_run, stats, tmp_path, n, needle):
    with pytest.raises(PipelineError, match=re.escape(needle)):
        subset(hs_run, stats, n, tmp_path)
    assert not (tmp_path / SUBSET_DIR).exists()


def test_train_draft_trains_on_the_subset_and_records_it(hs_run, stats, tmp_path):
    """The real trainer on a subset: speculators reads the view, the provenance says how many
    conversations, rows and tokens the draft trained on; too large a size stops the job
    before any checkpoint, naming the setting and the counts."""
    out = tmp_path / "drafts" / "n12"
    settings = {**SETTINGS, "max_conversations": 12}
    run_script("train_draft.py", *train_args(hs_run, settings, out), "--tokenized-stats", stats, timeout=600)
    prov = json.loads((out / "provenance.json").read_text())
    view = out / "checkpoints" / SUBSET_DIR
    argv = prov["trainer_argv"]
    assert argv[argv.index("--data-path") + 1] == str(view.resolve())
    rows = json.loads((view / SUBSET_ROWS).read_text())["rows"]
    used = prov["training_data"]
    assert used["conversations"] == 12 and used["of_conversations"] == CONVERSATIONS and used["rows"] == len(rows)
    assert prov["inputs"]["tokenized_stats"]["path"] == str(stats)
    # The same size and seed in another job picks the same rows.
    assert rows == subset(hs_run, stats, 12, tmp_path / "again").rows

    proc = run_script("train_draft.py", *train_args(hs_run, {**settings, "max_conversations": 99}, tmp_path / "big"),
                      "--tokenized-stats", stats, check=False, timeout=300)
    assert proc.returncode != 0
    assert (f"setting train.max_conversations = 99 is larger than this run's training data: {CONVERSATIONS} "
            f"conversations") in proc.stdout + proc.stderr
    assert not list((tmp_path / "big" / "checkpoints").glob("[0-9]*"))


def test_sizes_share_every_upstream_instance_in_the_plan(tmp_path, test_config):
    """Variants that differ only in max_conversations: one traces, tokenized and hidden-states
    instance for all of them, one train_draft per size, each told its size and the stats."""
    cfg = with_defaults(test_config)
    cfg["variants"] = {"default": {}, "n8": {"max_conversations": 8}, "n16": {"train": {"max_conversations": 16}}}
    base = {"traces": "traces", "tokenized": "tokenized", "hidden_states": "hidden_states"}
    for v in cfg["variants"]:
        assert {s: i.dir for s, i in stages.instances_for(cfg, stages.variant_config(cfg, v)).items()} == base
    out = run_snakemake(tmp_path, cfg, "-n").stdout
    jobs = planned_jobs(out)
    assert jobs["traces_gather"] == jobs["tokenize"] == jobs["hidden_states_gather"] == 1
    assert jobs["train_draft"] == 3 and jobs["compare_variants"] == 1
    commands = {m.group(2): m.group(0) for m in re.finditer(
        r"train_draft\.py --settings '([^']*)'.*?--final results/tiny/drafts/([\w.-]+)/final", out)}
    for v, n in (("default", None), ("n8", 8), ("n16", 16)):
        assert json.loads(re.search(r"--settings '([^']*)'", commands[v]).group(1))["max_conversations"] == n
        assert "--tokenized-stats results/tiny/tokenized/stats.json" in commands[v]


# ------------------------------------------------------------------------- the comparison

def report(variant: str, conversations: int | None, hit_rate: float, changed: dict | None = None) -> dict:
    """A verification.json as make_report writes it, with the parts the comparison reads: the
    trained draft's per-prompt acceptance over two suites (drafts accepted at `hit_rate`)."""
    requests = []
    for suite, n in (("eval", 12), ("code", 6)):
        for i in range(n):
            drafts = 10 + i
            requests.append({"id": f"{suite}/{i}", "suite": suite, "category": suite, "num_drafts": drafts,
                             "num_accepted_tokens": round(drafts * hit_rate * (1 + 0.1 * (i % 3))),
                             "degenerate": None})
    figures = suite_figures(requests)
    size = {} if conversations is None else {"conversations": conversations, "of_conversations": 20, "rows": conversations,
                                             "train_rows": conversations - 1, "tokens": 100 * conversations}
    return {"variant": variant, "verdict": {"passed": True},
            "lineage": {"changed_settings": changed or {}, "stage_instances": {}},
            "acceptance": {"requests": {"trained": requests}},
            "suites": {"bootstrap": {"samples": 500, "seed": 0}, "labels": {"eval": "MT-Bench", "code": "HumanEval"},
                       "trained": {"figures": {s: {**f, "degenerate": {"count": 0}} for s, f in figures.items()}}},
            "training": {"training_data": size}}


def compare(tmp_path: Path, reports: list[dict]) -> tuple[str, list[dict]]:
    import csv

    paths = []
    for r in reports:
        path = tmp_path / r["variant"] / "verification.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(r))
        paths.append(path)
    run_script("compare_variants.py", "--reports", *paths, "--out", tmp_path / "c.csv",
               "--markdown", tmp_path / "c.md", "--html", tmp_path / "c.html")
    with open(tmp_path / "c.csv") as f:
        return (tmp_path / "c.md").read_text(), list(csv.DictReader(f))


def test_comparison_shows_tau_against_conversations_and_the_last_steps_gain(tmp_path):
    reports = [report("default", 20, 0.6), report("n5", 5, 0.3, {"train.max_conversations": 5}),
               report("n10", 10, 0.5, {"train.max_conversations": 10}),
               # another lever at one size: not on the curve (it differs in more than the size)
               report("lr", 20, 0.4, {"train.lr": 0.01})]
    md, rows = compare(tmp_path, reports)
    assert "# Data scaling: acceptance against training conversations" in md
    table = md.split("# Data scaling")[1]
    lines = [line for line in table.splitlines() if line.startswith("| n") or line.startswith("| default")]
    assert [line.split("|")[1].strip() for line in lines[:3]] == ["n5", "n10", "default"]  # by size
    assert [line.split("|")[3].strip() for line in lines[:3]] == ["5 of 20", "10 of 20", "20 of 20"]
    assert "| lr |" not in table
    # The last step: n10 -> default, 10 conversations added, the paired difference / 10.
    by_suite = lambda r: {s: [q for q in r["acceptance"]["requests"]["trained"] if q["suite"] == s]  # noqa: E731
                          for s in ("eval", "code")}
    for suite, label in (("eval", "MT-Bench"), ("code", "HumanEval")):
        diff = paired_difference(by_suite(reports[2])[suite], by_suite(reports[0])[suite], 500, 0)
        step = next(line for line in table.splitlines() if line.startswith(f"| {label} | n10 (10) -> default (20)"))
        assert f"| 10 | {diff['difference']:.3f} [{diff['interval'][0]:.3f}, {diff['interval'][1]:.3f}] |" in step
        assert f"{1000 * diff['difference'] / 10:.3f}" in step
        default = next(r for r in rows if r["variant"] == "default")
        assert float(default[f"suite:{suite}:gain_per_conversation_vs_n10"]) == pytest.approx(diff["difference"] / 10)
    assert {r["variant"]: r["trained_on_conversations"] for r in rows} == {"default": "20", "n5": "5", "n10": "10",
                                                                          "lr": "20"}
    html = (tmp_path / "c.html").read_text()
    assert 'alt="Mean acceptance length against training conversations"' in html


def test_no_scaling_table_without_two_sizes(tmp_path):
    md, _ = compare(tmp_path, [report("default", 20, 0.6), report("lr", 20, 0.4, {"train.lr": 0.01}),
                               report("old", None, 0.5, {"train.max_conversations": 5})])
    assert "Data scaling" not in md
