"""Multi-turn self-distillation on the tiny target: the target answers every user turn with its
own earlier answers in context (generation.turns: all), the training row masks exactly the
tokens it generated in all turns, the summaries count answered / failed / dropped turns, and
the same prompts with generation.turns: first or generation.source: dataset.

One transformers run (greedy, batch size 1, no reasoning parser: the answers chain into one
training row) generates; the `first` and `dataset` runs start no model. test_traces.py runs
the same multi-turn path through vLLM offline and the OpenAI-compatible server."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from conftest import run_script
from test_traces import read_rows, traces, write_jsonl, write_manifest

LONG_TURN = "word " * 2100  # longer than the tiny target's 2048-token context
CONVERSATIONS = {
    # three user turns; the source answers the first two
    "mt:0": [("Hi! Do you like hiking?", "I love it."), ("Where do you usually go?", "The mountains."),
             ("What do you bring along?", None)],
    # four user turns, every one answered by the source; max_turns 3 leaves the fourth
    "mt:1": [("What's your favourite food?", "Pasta."), ("Which sauce?", "Pesto."), ("Homemade?", "Always."),
             ("Can you share the recipe?", "Basil, pine nuts, garlic.")],
    # one user turn, no answer
    "mt:2": [("Tell me a joke.", None)],
    # the second turn is longer than the context: it fails, the third is dropped
    "mt:3": [("Good morning!", "Morning!"), (LONG_TURN, None), ("Still there?", "Yes.")],
}
SETTINGS = {"backend": "transformers", "max_tokens": 12, "temperature": 0.0, "top_p": 1.0, "seed": 0,
            "reasoning_parser": None, "batch_size": 1, "retries": 1, "request_timeout_s": 120,
            "turns": "all", "max_turns": 3}


def prompt_row(pid: str, turns: list[tuple[str, str | None]]) -> dict:
    row = {"id": pid, "messages": [{"role": "user", "content": turns[0][0]}], "category": None, "source": "mt"}
    if len(turns) > 1 or turns[0][1] is not None:
        row["turns"] = [{"user": u, "assistant": a} for u, a in turns]
    return row


def all_turns(row: dict) -> list[dict]:
    return [row, *row["later_turns"]]


@pytest.fixture(scope="module")
def mt(tmp_path_factory, tiny_target):
    d = tmp_path_factory.mktemp("multiturn")
    write_jsonl(d / "train.jsonl", [prompt_row(pid, turns) for pid, turns in CONVERSATIONS.items()])
    write_manifest(tiny_target, d / "manifest.json")
    inp = SimpleNamespace(dir=d, target=tiny_target, prompts=d / "train.jsonl", manifest=d / "manifest.json")
    cache = d / "cache"
    every = traces(inp, SETTINGS, 0, 1, cache, d / "all")
    first = traces(inp, {**SETTINGS, "turns": "first"}, 0, 1, cache, d / "first")
    dataset = traces(inp, {**SETTINGS, "source": "dataset"}, 0, 1, d / "cache-dataset", d / "dataset")
    return SimpleNamespace(inp=inp, all=every, first=first, dataset=dataset,
                           by_id={r["id"]: r for r in every.rows})


@pytest.fixture(scope="module")
def renderer(tiny_target):
    import tokenize_traces as tt
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    return tt.ChatRenderer(tok, tt.end_of_turn_ids(tiny_target, tok), {})


def encode(renderer, row: dict):
    import tokenize_traces as tt

    counts = tt.Counts()
    return renderer.encode(tt.TraceRow.parse(row, "traces.jsonl"), counts), counts


def test_three_turns_three_answers_each_conditioned_on_the_earlier_ones(mt, renderer, tiny_target):
    import torch
    from transformers import AutoModelForCausalLM

    row = mt.by_id["mt:0"]
    turns = all_turns(row)
    assert len(turns) == 3 and row["turns_total"] == 3 and row["turns_dropped"] == 0
    assert [t["user"] for t in row["later_turns"]] == [u for u, _ in CONVERSATIONS["mt:0"][1:]]
    assert all(t["finish_reason"] in ("stop", "length") and t["token_ids"] for t in turns)
    # The source's own answers are not in the context: the target's are.
    assert "I love it." not in json.dumps(row)

    [(ids, mask)], counts = encode(renderer, row)  # the answers chain into one training row
    # The loss mask is exactly the tokens the target generated, in all three turns.
    assert [t for t, m in zip(ids, mask) if m] == [t for turn in turns for t in turn["token_ids"]]
    assert (counts.turns_spliced, counts.turns_in_loss, counts.conversations_split) == (3, 3, 0)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.bfloat16).eval()
    end_of_previous = 0
    for k, turn in enumerate(turns):
        start, gen = turn["prompt_tokens"], turn["token_ids"]
        # Turn k's prompt (what the backend counted) is the row up to its answer, and it holds
        # answer k-1's tokens, exactly as generated, before the next user turn.
        assert ids[start:start + len(gen)] == gen and all(mask[start:start + len(gen)])
        assert start > end_of_previous and not any(mask[end_of_previous:start])  # template + next user turn
        if k:
            previous = turns[k - 1]["token_ids"]
            assert ids[end_of_previous - len(previous):end_of_previous] == previous  # inside ids[:start]
        # And the answer is the target's greedy continuation of exactly that prompt.
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids[:start]]), max_new_tokens=len(gen), do_sample=False,
                                 eos_token_id=sorted(renderer.end_of_turn_ids), pad_token_id=0)
        assert out[0, start:].tolist() == gen, k
        end_of_previous = start + len(gen)
    assert end_of_previous == len(ids)


def test_summary_counts_answered_failed_and_dropped_turns(mt):
    s = mt.all.summary
    # mt:0 3 answered; mt:1 3 answered, 1 past max_turns; mt:2 1; mt:3 1 answered, 1 failed, 1 dropped
    assert (s["turns_total"], s["turns_answered"], s["turns_failed"], s["turns_dropped"]) == (11, 8, 1, 2)
    assert (s["rows"], s["ok"], s["failed"], s["rows_with_dropped_turns"]) == (4, 4, 0, 2)
    assert (s["generated"], s["reused"], s["turns"], s["max_turns"]) == (9, 0, "all", 3)
    failed = mt.by_id["mt:3"]["later_turns"]
    assert [t["finish_reason"] for t in failed] == ["error"] and "2048" in failed[0]["error"]
    assert (mt.by_id["mt:1"]["turns_dropped"], mt.by_id["mt:3"]["turns_dropped"]) == (1, 1)
    assert "turns: 8 answered, 1 failed, 2 of 11 dropped (generation.turns = all)" in mt.all.proc.stdout


def test_failed_later_turn_ends_the_training_conversation(mt, renderer):
    pieces, counts = encode(renderer, mt.by_id["mt:3"])
    assert len(pieces) == 1 and counts.turns_failed == 1 and counts.turns_in_loss == 1
    ids, mask = pieces[0]
    assert [t for t, m in zip(ids, mask) if m] == mt.by_id["mt:3"]["token_ids"]


def test_first_turns_only_counts_the_dropped_turns_and_reuses_the_cache(mt):
    s = mt.first.summary
    assert (s["generated"], s["reused"]) == (0, 4)  # `first` and `all` share first turns
    assert "loading" not in mt.first.proc.stdout  # no model was started
    assert (s["turns_total"], s["turns_answered"], s["turns_dropped"], s["rows_with_dropped_turns"]) == (11, 4, 7, 3)
    for row in mt.first.rows:
        ref = mt.by_id[row["id"]]
        assert row["later_turns"] == [] and row["turns_dropped"] == row["turns_total"] - 1
        assert {k: row[k] for k in ("answer", "token_ids", "prompt_tokens")} == \
            {k: ref[k] for k in ("answer", "token_ids", "prompt_tokens")}


def test_dataset_answers_instead_of_generated_ones(mt, renderer):
    s = mt.dataset.summary
    assert s["backend"] == "dataset" and (s["generated"], s["reused"]) == (0, 0)
    assert "loading" not in mt.dataset.proc.stdout
    rows = {r["id"]: r for r in mt.dataset.rows}
    for pid, conversation in CONVERSATIONS.items():
        answers = [a for _, a in conversation[:3]]
        given = answers[:answers.index(None)] if None in answers else answers
        row = rows[pid]
        assert row["backend"] == "dataset" and row["sampling"] is None
        if not given:  # no answer to the first turn: an error row, never trained on
            assert row["finish_reason"] == "error" and "source 'mt' has no assistant answer" in row["error"]
            continue
        assert [t["answer"] for t in all_turns(row)] == given
        assert all(t["token_ids"] is None and t["finish_reason"] == "stop" for t in all_turns(row))
        assert row["turns_dropped"] == len(conversation) - len(given)
        # Same tokenization and masks, from re-encoded text: answer + end of turn, every turn.
        [(ids, mask)], counts = encode(renderer, row)
        eot = sorted(renderer.end_of_turn_ids)[0]
        expected = [t for a in given for t in renderer.tok(a, add_special_tokens=False)["input_ids"] + [eot]]
        assert [t for t, m in zip(ids, mask) if m] == expected
        assert (counts.turns_reencoded, counts.turns_spliced, counts.roundtrip_differs) == (len(given), 0, 0)
    assert (s["failed"], s["turns_answered"]) == (1, 2 + 3 + 0 + 1)


def test_dataset_source_without_answers_is_refused_naming_it(mt, tmp_path):
    bench = dict(prompt_row("mtbench:1", [("Compose a travel blog post.", None), ("Rewrite it.", None)]),
                 source="mtbench")
    prompts = tmp_path / "train.jsonl"
    write_jsonl(prompts, [prompt_row("mt:0", CONVERSATIONS["mt:0"]), bench])
    inp = SimpleNamespace(**{**vars(mt.inp), "prompts": prompts})
    res = traces(inp, {**SETTINGS, "source": "dataset"}, 0, 1, tmp_path / "cache", tmp_path / "out", check=False)
    assert res.proc.returncode == 2
    assert "generation.source = dataset" in res.proc.stderr and "['mtbench']" in res.proc.stderr
    assert "'mtbench:1'" in res.proc.stderr and "Traceback" not in res.proc.stderr
    assert not res.out.exists()


def test_gather_refuses_shards_of_different_turn_settings(mt, tmp_path):
    """Shards made with `all` and `first` share the generation key (the answers agree) but not
    the rows' shape: gathering them would mix conversations cut at different turns."""
    prompts = read_rows(mt.inp.prompts)
    write_jsonl(tmp_path / "train.jsonl", prompts)
    inp = SimpleNamespace(**{**vars(mt.inp), "prompts": tmp_path / "train.jsonl"})
    cache = mt.inp.dir / "cache"
    runs = [traces(inp, {**SETTINGS, "turns": turns}, i, 2, cache, tmp_path / "shards")
            for i, turns in enumerate(("all", "first"))]
    res = run_script("gather_traces.py", "--shards", *(r.out for r in runs), "--out", tmp_path / "t.jsonl",
                     "--summary", tmp_path / "s.json", "--provenance", tmp_path / "p.json", check=False)
    assert res.returncode == 2 and "different settings" in res.stderr, res.stderr
