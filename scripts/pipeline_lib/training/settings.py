"""The `train` config section of one variant, and the settings CPU training needs."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .. import cli, draft_types
from ..draft_types import check_type_settings
from ..errors import PipelineError

SECTION = "train"


@dataclass(frozen=True)
class TrainSettings:
    draft_layers: int
    draft_vocab_size: int
    ttt_steps: int
    epochs: int
    lr: float
    optimizer: str
    scheduler: str
    total_seq_len: int
    train_data_ratio: float
    attn_impl: str
    loss_impl: str
    seed: int
    keep_last: int
    select: str
    num_workers: int
    extend_epochs: bool = False
    max_conversations: int | None = None   # None: all of the run's training conversations
    draft_type: str = "eagle3"             # speculators' --speculator-type (pipeline_lib/draft_types.py)
    block_size: int | None = None          # DFlash family / XPress: queries per anchor (None: the type's default)
    num_depths: int | None = None          # P-EAGLE: parallel prediction depths (None: speculators' 8)
    max_anchors: int | None = None         # parallel types: anchor positions per sequence (None: 512)
    # speculators' --hidden-states-dtype: autocast and hidden-states dtype (the workflow resolves
    # `auto`: pipeline_lib/dtypes.py); bfloat16 is speculators' own default.
    dtype: str = "bfloat16"

    OPTIONAL = {"extend_epochs": False, "max_conversations": None, "draft_type": "eagle3", "block_size": None,
                "num_depths": None, "max_anchors": None, "dtype": "bfloat16"}
    CHOICES = {"draft_type": tuple(draft_types.DRAFT_TYPES), "optimizer": ("adamw", "muon"), "scheduler": ("linear", "cosine", "none"),
               "attn_impl": ("sdpa", "simple_flex_attention", "eager"),
               "loss_impl": ("eager", "fused"), "select": ("best", "last"),
               # float16 needs gradient scaling, which speculators refuses; `auto` is resolved by the workflow
               "dtype": ("bfloat16", "float32")}
    MINIMA = {"draft_layers": 1, "draft_vocab_size": 2, "ttt_steps": 1, "epochs": 1,
              "total_seq_len": 16, "keep_last": 1, "num_workers": 0}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TrainSettings":
        values = {}
        for name, kind in cls.__annotations__.items():  # the fields (CHOICES/MINIMA are not annotated)
            value = raw.get(name, cls.OPTIONAL[name]) if name in cls.OPTIONAL else cli.require(raw, name, SECTION)
            if kind == "bool" and not isinstance(value, bool):
                raise PipelineError(f"setting {SECTION}.{name} = {value!r}: expected true or false")
            if kind == "int | None" and value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                                                or value < 1):
                raise PipelineError(f"setting {SECTION}.{name} = {value!r}: expected a positive integer or null")
            if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise PipelineError(f"setting {SECTION}.{name} = {value!r}: expected an integer")
            if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise PipelineError(f"setting {SECTION}.{name} = {value!r}: expected a number")
            if name in cls.CHOICES and value not in cls.CHOICES[name]:
                raise PipelineError(f"setting {SECTION}.{name} = {value!r}: choose one of "
                                    f"{', '.join(cls.CHOICES[name])}")
            if name in cls.MINIMA and value < cls.MINIMA[name]:
                raise PipelineError(f"setting {SECTION}.{name} = {value}: must be >= {cls.MINIMA[name]}")
            values[name] = float(value) if kind == "float" else value
        if values["lr"] <= 0:
            raise PipelineError(f"setting {SECTION}.lr = {values['lr']}: must be > 0")
        if not 0 < values["train_data_ratio"] < 1:
            raise PipelineError(
                f"setting {SECTION}.train_data_ratio = {values['train_data_ratio']}: speculators "
                f"validates on the last rows, so it must be strictly between 0 and 1 (e.g. 0.9)")
        check_type_settings(values)
        unknown = sorted(set(raw) - set(values))
        if unknown:
            raise PipelineError(f"unknown {SECTION} setting(s) {unknown}; see config.yaml for the valid keys")
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def type(self) -> draft_types.DraftType:
        return draft_types.get(self.draft_type)

    @property
    def speculative_tokens(self) -> int | None:
        """How many tokens a draft of this type is trained to propose per step, for the
        parallel types (vLLM asked for more runs them silently wrong); None for EAGLE-3, whose
        draft runs autoregressively for any k."""
        return self.type.trained_tokens(block_size=self.block_size, num_depths=self.num_depths)


def check_device_settings(settings: TrainSettings, on_cpu: bool) -> None:
    if not on_cpu:
        return
    problems = []
    if settings.attn_impl == "simple_flex_attention":
        problems.append("train.attn_impl: simple_flex_attention has no CPU backward; use sdpa")
    if settings.loss_impl == "fused":
        problems.append("train.loss_impl: the fused loss needs Triton (GPU); use eager")
    if settings.num_workers != 0:
        problems.append(f"train.num_workers = {settings.num_workers}: CPU training needs 0")
    if problems:
        raise PipelineError("training on CPU (no GPU requested or visible) needs other settings "
                            "for this variant: " + "; ".join(problems))
