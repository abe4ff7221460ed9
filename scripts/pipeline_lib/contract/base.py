"""What every contract check reads and returns, and the registry the checks join.

A check is a function of the Context (the draft, the target and what the earlier stages
recorded) that returns a Check (expected vs seen) or raises NotRun when something it needs is
missing or failed earlier. Checks are grouped in families (one module each); a family says
which draft types its checks apply to, since the contract differs between draft types
(`speculators_model_type`: eagle3, peagle, dflash, ...; the variant's train.draft_type), and a single check may widen that to
every draft type for what every checkpoint has. The registry keeps the report order: the order
the family modules are imported in (contract/__init__.py), then the order within each module."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from .. import draft_types
from ..errors import PipelineError
from ..target import text_config


@dataclass
class Check:
    name: str
    passed: bool | None
    expected: Any = None
    seen: Any = None
    detail: str = ""
    required: bool = True


class NotRun(Exception):
    """A check cannot run because something it needs is missing or failed earlier."""


# ---------------------------------------------------------------------------------------------
# What the checks read


def safetensors_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


class Weights:
    """Lazy view of a checkpoint's safetensors: names, shapes, dtypes; tensors on demand."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        self.files = safetensors_files(model_dir)
        if not self.files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors file")
        self._where: dict[str, Path] = {}
        self._raw: dict[str, str] = {}   # normalized name -> name in the file
        self.shapes: dict[str, list[int]] = {}
        self.dtypes: dict[str, str] = {}
        for f in self.files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    sl = st.get_slice(name)
                    key = name.replace("midlayer.", "layers.0.")  # older EAGLE-3 name vLLM also maps
                    self._where[key] = f
                    self._raw[key] = name
                    self.shapes[key] = list(sl.get_shape())
                    self.dtypes[key] = sl.get_dtype()

    def tensor(self, name: str):
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as st:
            return st.get_tensor(self._raw[name])


@dataclass
class Context:
    draft: Path
    target: Path
    target_config: dict
    target_manifest: dict
    hs_manifest: dict
    stats: dict
    settings: dict
    hs_record: dict | None = None   # what train_draft says it trained on (drafts/<v>/hidden_states.json)
    tokenized_data: Path | None = None  # R/tokenized/data (speculators' rows) and the traces they came from
    traces: Path | None = None
    draft_config: dict | None = None
    config_error: str | None = None
    _weights: Any = None
    _weights_error: str | None = None

    @property
    def draft_type(self) -> str:
        """The type the draft must be: the variant's train.draft_type."""
        return self.settings.get("draft_type", "eagle3")

    @property
    def tc(self) -> dict:
        return text_config(self.target_config)

    def config(self) -> dict:
        if self.draft_config is None:
            raise NotRun(f"draft config.json unusable ({self.config_error})")
        return self.draft_config

    def typed_config(self) -> dict:
        """The draft's config, once it is of the variant's draft type (the type-specific checks
        read it; a draft of another type fails config.speculators_model_type instead)."""
        cfg = self.config()
        if cfg.get("speculators_model_type") != self.draft_type:
            raise NotRun(f"the draft is not a {self.draft_type!r} speculator (see config.speculators_model_type)")
        return cfg

    def aux_layer_ids(self) -> Any:
        """The aux layer ids, under the key the draft type stores them (draft_types.py)."""
        return self.typed_config().get(draft_types.get(self.draft_type).aux_layers_key)

    def layer_config(self) -> dict:
        tl = self.typed_config().get("transformer_layer_config")
        if not isinstance(tl, dict):
            raise NotRun("transformer_layer_config missing (see config.transformer_layer_config)")
        return tl

    def weights(self) -> Weights:
        if self._weights is None and self._weights_error is None:
            try:
                self._weights = Weights(self.draft)
            except Exception as err:  # unreadable/truncated file: reported by weights.readable
                self._weights_error = f"{type(err).__name__}: {err}"
        if self._weights is None:
            raise NotRun(f"draft weights unreadable ({self._weights_error})")
        return self._weights


def load_draft_config(ctx: Context) -> None:
    path = ctx.draft / "config.json"
    if not path.exists():
        ctx.config_error = f"{path} not found"
        return
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        ctx.config_error = f"{path} is not valid JSON ({err})"
        return
    if not isinstance(cfg, dict):
        ctx.config_error = f"{path} is not a JSON object"
        return
    ctx.draft_config = cfg



# ---------------------------------------------------------------------------------------------
# The registry

CheckFn = Callable[[Context], Check]
EVERY_DRAFT_TYPE: frozenset[str] | None = None  # applies_to of a check any draft must pass
CHECKS: list[tuple[str, CheckFn]] = []           # (name, function), in report order
APPLIES_TO: dict[str, frozenset[str] | None] = {}  # check name -> draft types (None: every type)


class Family:
    """A group of checks of one concern, and the draft types they apply to."""

    def __init__(self, name: str, applies_to: Iterable[str] | None):
        self.name = name
        self.applies_to = EVERY_DRAFT_TYPE if applies_to is None else frozenset(applies_to)

    def check(self, name: str, every_draft_type: bool = False):
        """Register the decorated function as check `name`, for the family's draft types or,
        with `every_draft_type`, for any draft (a check of what every checkpoint has)."""
        scope = EVERY_DRAFT_TYPE if every_draft_type else self.applies_to

        def register(fn: CheckFn) -> CheckFn:
            if name in APPLIES_TO:
                raise ValueError(f"contract check {name!r} is registered twice")
            CHECKS.append((name, fn))
            APPLIES_TO[name] = scope
            return fn
        return register


def checks_for(draft_type: str) -> list[tuple[str, CheckFn]]:
    """The registered checks that apply to a draft of `draft_type`, in report order."""
    return [(name, fn) for name, fn in CHECKS
            if APPLIES_TO[name] is EVERY_DRAFT_TYPE or draft_type in APPLIES_TO[name]]


def run_check(name: str, fn: Callable[[Context], Check], ctx: Context) -> Check:
    try:
        result = fn(ctx)
        result.name = name
        return result
    except NotRun as why:
        return Check(name, None, None, None, f"not run: {why}")
    except PipelineError:  # a pipeline input (not the draft) is unusable: exit 2 naming it
        raise
    except Exception as err:  # a malformed field must not hide the other checks
        return Check(name, False, None, None, f"check crashed on this draft: {type(err).__name__}: {err}")

