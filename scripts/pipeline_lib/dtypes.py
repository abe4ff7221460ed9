"""Compute dtypes: what `auto` means for each stage, decided once per Snakemake invocation.

Five settings say what a stage computes in: generation.dtype (traces), hidden_states.dtype
(extraction; offline files stay bfloat16 when it is float32: hidden_file_dtype), train.dtype (speculators'
--hidden-states-dtype: the autocast dtype; master weights stay fp32, checkpoints bf16),
verify.dtype (the acceptance runs) and forecast.dtype (the speedup forecast's servers). Each may
be `auto` (their default):

- a stage given GPUs (resources.<stage>.gpu > 0; online hidden states: hidden_states.server_gpus)
  computes in bfloat16, whatever the planning host is;
- a stage on CPU computes in bfloat16 only where the CPU has bf16 matrix instructions
  (AVX512-BF16 or AMX on x86-64, BF16 on aarch64), else in float32: without them bf16 matmuls are
  emulated, 4-14x slower than float32 (measured: 6.5 vs 92 GFLOP/s on a 2-core AMD EPYC with AVX2
  only, torch 2.13). Verification on CPU is float32 either way: greedy equality with and without
  the draft is exact only there.

target.dtype is not a compute dtype: it is the dtype a GGUF is dequantized to on disk (a
local or hub target keeps its stored dtype); every stage casts the weights to its own dtype.

Where the CPU is judged: the Snakemake process that plans the run reads /proc/cpuinfo (and the
caps ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY / PIPELINE_TEST_CPU_ISA put on the kernels) once,
and exports the verdict as PIPELINE_CPU_BF16=native|emulated, so every job it starts, and every
SLURM job (sbatch --export=ALL) re-reading the workflow, resolves `auto` the same way. Set
PIPELINE_CPU_BF16 yourself to resolve as for another CPU (a cluster's nodes). The resolved
dtype, not `auto`, is part of each stage's settings: a run continued on a CPU that resolves
differently reruns the stages whose dtype changed (the plan says which dtype each gets and
why; setting the dtype explicitly keeps existing artifacts). Nothing is mixed: shards, caches
and stores are keyed by the dtype they were computed in.

PIPELINE_DTYPE_RESOLUTION carries the decision (as JSON) to the jobs, which record their
stage's entry in provenance (job_record)."""
from __future__ import annotations

import copy
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import PipelineError
from .resources import stage_gpus

AUTO = "auto"
CPU_ENV = "PIPELINE_CPU_BF16"            # native | emulated: the planning process's verdict
RESOLUTION_ENV = "PIPELINE_DTYPE_RESOLUTION"  # JSON: what resolve_in_place decided, for the jobs' provenance
# x86-64 flags (/proc/cpuinfo) of instructions that compute bf16 products natively; aarch64: "bf16".
X86_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
ARM_BF16_FLAGS = ("bf16",)
# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) that still allow its bf16 instructions.
ONEDNN_BF16_ISAS = {"AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
                    "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "ALL", "DEFAULT"}


# (config section, key) -> the resources stage whose GPUs decide, and what `auto` gives on CPU.
# verify keeps float32 on every CPU: bf16 greedy decoding drifts on near-tied logits, so the
# report's equality check with and without the draft is exact only in float32.
SETTINGS = {
    "generation": {"stage": "traces", "cpu": "by_cpu"},
    "hidden_states": {"stage": "hidden_states", "cpu": "by_cpu"},
    "train": {"stage": "train", "cpu": "by_cpu"},
    "verify": {"stage": "verify", "cpu": "float32"},
    # The speedup forecast serves the target like generation does (rules/forecast.smk).
    "forecast": {"stage": "forecast", "cpu": "by_cpu"},
}


def _cpu_flags(cpuinfo: str | Path) -> tuple[str, set[str]]:
    """(architecture, flags) from /proc/cpuinfo: x86 'flags', aarch64 'Features'."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "flags":
            return "x86_64", set(value.split())
        if key == "features":
            return "aarch64", set(value.split())
    return "unknown", set()


def _kernel_cap(environ) -> str | None:
    """Why the kernels are capped below bf16 instructions, if an environment variable does so."""
    isa = environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA")
    if isa and isa.upper() not in ONEDNN_BF16_ISAS:
        return f"ONEDNN_MAX_CPU_ISA={isa}"
    aten = environ.get("ATEN_CPU_CAPABILITY")
    if aten and aten.lower() in ("default", "avx2", "avx"):
        return f"ATEN_CPU_CAPABILITY={aten}"
    test_isa = environ.get("PIPELINE_TEST_CPU_ISA")
    if test_isa:
        return f"PIPELINE_TEST_CPU_ISA={test_isa}"
    return None


def probe_cpu(environ=None, cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, Any]:
    """Whether this CPU computes bf16 products natively: {"native": bool, "basis": why}.
    PIPELINE_CPU_BF16 (native | emulated), when set, decides instead of the CPU."""
    env = os.environ if environ is None else environ
    given = env.get(CPU_ENV)
    if given:
        if given not in ("native", "emulated"):
            raise PipelineError(f"{CPU_ENV}={given!r}: set it to native or emulated (or unset it: the CPU decides)")
        return {"native": given == "native", "basis": f"{CPU_ENV}={given}"}
    arch, flags = _cpu_flags(cpuinfo)
    wanted = ARM_BF16_FLAGS if arch == "aarch64" else X86_BF16_FLAGS
    found = sorted(f for f in wanted if f in flags)
    cap = _kernel_cap(env)
    if found and cap:
        return {"native": False, "basis": f"{', '.join(found)} in {cpuinfo} but the kernels are capped ({cap})"}
    if found:
        return {"native": True, "basis": f"{', '.join(found)} in {cpuinfo}"}
    simd = [f for f in ("avx512f", "avx2", "asimd") if f in flags][:1]
    return {"native": False, "basis": f"no {' / '.join(wanted)} in {cpuinfo} ({arch}"
                                      + (f", {simd[0]}" if simd else "") + ")"}


@lru_cache(maxsize=None)
def _cached_cpu(given: str | None) -> dict[str, Any]:
    return probe_cpu({CPU_ENV: given} if given else None)


def cpu() -> dict[str, Any]:
    """This process's verdict (PIPELINE_CPU_BF16 if set, else the CPU's), probed once."""
    return dict(_cached_cpu(os.environ.get(CPU_ENV)))


def device(cfg: dict, section: str) -> str:
    """Where the stage whose dtype `section` sets runs: "gpu" or "cpu"."""
    if section == "hidden_states" and (cfg.get("hidden_states") or {}).get("mode") == "online":
        # Online: the vLLM server in the training job, on hidden_states.server_gpus of its GPUs.
        return "gpu" if int(cfg["hidden_states"].get("server_gpus") or 0) > 0 else "cpu"
    return "gpu" if stage_gpus(cfg, SETTINGS[section]["stage"]) > 0 else "cpu"


def resolve_one(cfg: dict, section: str, cpu_verdict: dict[str, Any]) -> dict[str, Any]:
    """{"setting", "dtype", "device", "why"} for one section's dtype."""
    setting = (cfg.get(section) or {}).get("dtype", AUTO)
    where = device(cfg, section)
    stage = SETTINGS[section]["stage"]
    entry = {"setting": setting, "device": where}
    if setting != AUTO:
        return {**entry, "dtype": setting, "why": f"{section}.dtype is set"}
    gen = cfg.get("generation") or {}
    if section == "generation" and (gen.get("backend") == "openai" or gen.get("source") == "dataset"):
        # Nothing here computes: the endpoint runs in its own dtype (or the prompt set answers).
        return {**entry, "dtype": None, "why": "auto: not used (generation.backend openai or source dataset)"}
    if where == "gpu":
        return {**entry, "dtype": "bfloat16", "why": f"auto: resources.{stage}.gpu > 0"
                if not (section == "hidden_states" and cfg["hidden_states"].get("mode") == "online")
                else "auto: online server on hidden_states.server_gpus > 0 GPU(s)"}
    if SETTINGS[section]["cpu"] == "float32":
        return {**entry, "dtype": "float32", "why": "auto on CPU: float32, where greedy equality is exact"}
    if cpu_verdict["native"]:
        return {**entry, "dtype": "bfloat16", "why": "auto on a CPU with native bf16"}
    return {**entry, "dtype": "float32", "why": "auto on a CPU without native bf16 (emulated bf16 is slower)"}


def resolution(cfg: dict, cpu_verdict: dict[str, Any] | None = None) -> dict[str, Any]:
    """What each dtype setting of `cfg` resolves to: {section: entry} plus {"cpu": verdict}.
    Sections absent from `cfg` are left out."""
    verdict = cpu() if cpu_verdict is None else cpu_verdict
    out: dict[str, Any] = {s: resolve_one(cfg, s, verdict) for s in SETTINGS if isinstance(cfg.get(s), dict)}
    out["cpu"] = verdict
    return out


def resolve(cfg: dict, cpu_verdict: dict[str, Any] | None = None) -> dict:
    """A copy of `cfg` with every `auto` dtype replaced by its resolved dtype (others as they are)."""
    out = dict(cfg)
    for section, entry in resolution(cfg, cpu_verdict).items():
        if section != "cpu" and cfg[section].get("dtype", AUTO) == AUTO and "dtype" in cfg[section]:
            out[section] = {**cfg[section], "dtype": entry["dtype"]}
    return out


def resolve_in_place(config: dict) -> dict[str, Any]:
    """Parse time: resolve the validated config's `auto` dtypes in place (every rule, and every
    reader of `config`, sees the resolved dtype), export the CPU verdict and the decision to the
    jobs, and return the decision (for the plan)."""
    verdict = probe_cpu()
    os.environ.setdefault(CPU_ENV, "native" if verdict["native"] else "emulated")
    decided = resolution(config, verdict)
    for section, entry in decided.items():
        if section != "cpu" and "dtype" in config[section]:
            config[section]["dtype"] = entry["dtype"]
    os.environ[RESOLUTION_ENV] = json.dumps(decided, sort_keys=True)
    return copy.deepcopy(decided)


def planned(cfg: dict) -> dict[str, Any]:
    """The decision behind `cfg`'s dtypes: the workflow's (PIPELINE_DTYPE_RESOLUTION, when it
    gives the same dtypes: it says which were `auto` and why), else resolved here."""
    decided = resolution(cfg)
    try:
        given = json.loads(os.environ.get(RESOLUTION_ENV) or "{}")
    except ValueError:
        given = {}
    same = all((given.get(s) or {}).get("dtype") == e["dtype"] for s, e in decided.items() if s != "cpu")
    return given if given and same else decided


def job_record(section: str, dtype: str | None, on_gpu: bool | None = None) -> dict[str, Any]:
    """What a job records in provenance about its compute dtype: the planner's decision for its
    section (when this job was started by the workflow that made it, and it matches), and this
    host's own CPU verdict."""
    host_env = {k: v for k, v in os.environ.items() if k != CPU_ENV}  # this CPU (and its kernel caps)
    record: dict[str, Any] = {"dtype": dtype, "host_cpu_bf16": probe_cpu(host_env)}
    if on_gpu is not None:
        record["device"] = "gpu" if on_gpu else "cpu"
    try:
        planned = json.loads(os.environ.get(RESOLUTION_ENV) or "{}").get(section)
    except ValueError:
        planned = None
    if planned and planned.get("dtype") == dtype:
        record.update(setting=planned.get("setting"), why=planned.get("why"), planned_device=planned.get("device"))
    else:
        record.update(setting=dtype, why="given in --settings (not planned by the workflow)")
    return record


def hidden_file_dtype(compute_dtype: str) -> str:
    """The dtype of offline hidden-state files (storage bf16) computed in `compute_dtype`: float32
    is written as bfloat16, so the files' format and size do not depend on the CPU that made them;
    bfloat16 and float16 as computed."""
    return "bfloat16" if compute_dtype == "float32" else compute_dtype


def describe(decided: dict[str, Any]) -> list[str]:
    """Plan lines: one per stage, then the CPU verdict."""
    names = {"generation": "traces", "hidden_states": "hidden states", "train": "training", "verify": "verify"}
    lines = [f"{names[s]:<14} {str(e['dtype'] or '-'):<9} ({e['device']}; {e['why']})"
             for s, e in decided.items() if s in names]
    return lines
