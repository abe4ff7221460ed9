"""docs/troubleshooting.md (and the README's Troubleshooting section) quote what the user sees:
each quote must still be in the code that prints it (the pipeline's scripts, the Makefile, or
the installed vLLM and Snakemake), and an architecture vLLM does not know fails the trace stage's
vLLM backend with the message the page shows."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import PY, REPO

PAGE = REPO / "docs" / "troubleshooting.md"


def installed(relative: str) -> Path:
    """A file of an installed package in the test venv (lib/pythonX.Y/site-packages/...)."""
    (found,) = Path(PY).parents[1].glob(f"lib/python*/site-packages/{relative}")
    return found


# (what the page quotes, the file that prints it, the code's text with its placeholders)
QUOTES = [
    ("ERROR: vLLM\ncould not load the target <dir>: <error>; see the traceback above in this job's log",
     "scripts/pipeline_lib/generation/vllm_backend.py",
     "vLLM could not load the target {self.target}: {type(err).__name__}: {err}; see the traceback above in this job's log"),
    ("ERROR: vLLM could not run\n  <draft> as the EAGLE-3 draft of <target>:", "scripts/load_check.py",
     "vLLM could not run {draft} as the {draft_type.title} draft of {target}: "),
    ("eagle_aux_hidden_state_layer_ids is missing; vLLM would\n  silently use its default layers. Re-run train_draft",
     "scripts/load_check.py", "is missing; vLLM would silently use its default layers. Re-run train_draft"),
    ("load check FAILED: the draft proposed\n  no tokens", "scripts/load_check.py", "load check FAILED: "),
    ("load check FAILED: the draft proposed\n  no tokens", "scripts/load_check.py", "the draft proposed no tokens"),
    ("`[contract] FAIL <check>: <what differs>`", "scripts/check_contract.py",
     "[contract] {mark} {c['name']}"),
    ("`[contract] FAILED: ...`", "scripts/check_contract.py", "[contract] {'PASSED' if passed else 'FAILED'}: "),
    ("`[report] <variant>: FAIL: contract checks failed: <checks>`", "scripts/make_report.py",
     "[report] {args.variant}: FAIL: "),
    ("contract checks failed: <checks>", "scripts/pipeline_lib/report/verdict.py", "contract checks failed: "),
    ("`acceptance could\n  not be measured (<run>): <vLLM's message>`", "scripts/pipeline_lib/report/verdict.py",
     "acceptance could not be measured ({acceptance.get('error_run')}): {acceptance.get('error')}"),
    ("`ERROR: <dir>: the tokenizer does not load (<error>) (if it needs custom code, set\ntarget.trust_remote_code: true)`",
     "scripts/materialize_target.py", "the tokenizer does not load ({type(err).__name__}: {err}){hint}"),
    ("(if it needs custom code, set\ntarget.trust_remote_code: true)", "scripts/materialize_target.py",
     " (if it needs custom code, set target.trust_remote_code: true)"),
    ("the load check\nitself runs vLLM without remote code", "scripts/load_check.py", "trust_remote_code=False,"),
    ("needs a decoder with `.layers` and a final `.norm`",
     "scripts/pipeline_lib/hidden_states/transformers_backend.py",
     "the transformers backend needs a decoder with `.layers` "),
    ("`[demo] Snakemake's lock stopped this run\n(.snakemake/locks)`", "Makefile",
     "[demo] Snakemake's lock stopped this run (.snakemake/locks)"),
    ("`VLLM_CPU_KVCACHE_SPACE` GiB, which the pipeline sets to 1 unless\nyou set it", "scripts/pipeline_lib/runtime.py",
     'os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")'),
    ("two engines at 0.45 of the card each", "scripts/pipeline_lib/acceptance/vllm_backend.py",
     'kwargs["gpu_memory_utilization"] = 0.45'),
    ("`No available memory for the cache blocks`", "vllm/v1/core/kv_cache_utils.py",
     "No available memory for the cache blocks. "),
    ("KV cache is needed, which is larger\nthan the available KV cache memory", "vllm/v1/core/kv_cache_utils.py",
     "KV cache is needed, which is larger than the available KV cache memory"),
    ("`Model does not support EAGLE3 interface but\naux_hidden_state_outputs was requested`",
     "vllm/v1/worker/gpu_model_runner.py", "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"),
    ("`Error: Directory cannot be locked. Please make\nsure that no other Snakemake process is trying to create the same "
     "files in the following\ndirectory: ...`", "snakemake/exceptions.py",
     "Error: Directory cannot be locked. Please make sure that no other Snakemake process is trying to create the "
     "same files in the following directory:"),
]


# The README's Troubleshooting section quotes the same messages, shorter.
README_QUOTES = [
    ("vLLM's `No available memory for the cache\n  blocks`", "vllm/v1/core/kv_cache_utils.py",
     "No available memory for the cache blocks. "),
    ("`ERROR: vLLM could not run <draft> as the EAGLE-3 draft of\n  <target>: <vLLM's error>`", "scripts/load_check.py",
     "vLLM could not run {draft} as the {draft_type.title} draft of {target}: "),
    ("`[report] <variant>: FAIL: contract checks\n  failed: <checks>`", "scripts/make_report.py",
     "[report] {args.variant}: FAIL: "),
    ("`ERROR: vLLM could not load the target <dir>: ... Model\n  architectures ['...'] are not supported for now`",
     "scripts/pipeline_lib/generation/vllm_backend.py", "vLLM could not load the target {self.target}: "),
    ("`the tokenizer does\n  not load (...) (if it needs custom code, set target.trust_remote_code: true)`",
     "scripts/materialize_target.py", " (if it needs custom code, set target.trust_remote_code: true)"),
    ("`Error: Directory cannot be locked`", "snakemake/exceptions.py", "Error: Directory cannot be locked. "),
    ("`make unlock`", "Makefile", "unlock: env"),
]


def joined_literals(source: str) -> str:
    """Source text with adjacent string literals split over lines joined ("ab "\\n  f"cd" -> "ab cd")."""
    return re.sub(r"""(["'])\s*\n\s*[fr]?(["'])""", "", source)


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("quote, path, code", QUOTES, ids=[f"{p}:{c[:40]}" for _, p, c in QUOTES])
def test_each_quoted_message_is_in_the_code_that_prints_it(quote, path, code):
    assert flat(quote) in flat(PAGE.read_text()), f"docs/troubleshooting.md no longer quotes {quote!r}"
    source = REPO / path if (REPO / path).exists() else installed(path)
    assert code in joined_literals(source.read_text()), f"{path} no longer prints {code!r}"


def test_an_architecture_vllm_does_not_know_fails_the_trace_backend_with_vllms_message(tiny_target, tmp_path):
    from pipeline_lib import runtime
    from pipeline_lib.errors import PipelineError
    from pipeline_lib.generation import base

    target = tmp_path / "foo"
    shutil.copytree(tiny_target, target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["FooBarForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    runtime.setup()
    backend = base.make_backend(base.GenerationSettings(), target, "bfloat16", log=lambda line: None)
    with pytest.raises(PipelineError) as err:
        backend.start()
    message = str(err.value)
    assert message.startswith(f"vLLM could not load the target {target}: ValidationError: "), message[:500]
    assert "Model architectures ['FooBarForCausalLM'] are not supported for now. Supported architectures:" in message
    page = flat(PAGE.read_text())
    assert ("ERROR: vLLM could not load the target <dir>: ValidationError: 1 validation error for ModelConfig Value "
            "error, Model architectures ['FooBarForCausalLM'] are not supported for now.") in page


@pytest.mark.parametrize("quote, path, code", README_QUOTES, ids=[f"{p}:{c[:40]}" for _, p, c in README_QUOTES])
def test_the_readmes_troubleshooting_quotes_what_the_code_prints(quote, path, code):
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Troubleshooting\n", 1)[1].split("\n## ", 1)[0]
    assert flat(quote) in flat(section), f"README.md's Troubleshooting no longer quotes {quote!r}"
    source = REPO / path if (REPO / path).exists() else installed(path)
    assert code in joined_literals(source.read_text()), f"{path} no longer prints {code!r}"
