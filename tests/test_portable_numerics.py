"""The tests marked `numerics` once more, with the CPU kernels capped to AVX2 (`make test-portable`).

Figures of trained drafts follow the CPU's kernel path: AMX, AVX512-BF16 and AVX2 bf16 matrix
products round differently, so the hidden states and every draft trained on them differ between
machines (docs/testing.md). Here those tests run in a pytest of their own whose every process,
Snakemake's jobs and vLLM's engines included, runs on AVX2 kernels: torch capped by
ATEN_CPU_CAPABILITY, oneDNN by ONEDNN_MAX_CPU_ISA, and the kernels vLLM picks by
tests/kernel_path/sitecustomize.py, which hides the wider flags from torch.cpu. The caps must be
in a process's environment before it imports torch, hence a pytest of their own; it builds its
own e2e run, so every figure it compares, from the traces on, comes from AVX2 kernels.

As one test of the suite, it runs on one worker while the other runs the rest (`make test`'s two
workers; tests/conftest.py schedules it right after the e2e run's unit), instead of after the
suite. Its figures join the run's `figures compared by the numeric guards`, labelled `capped to
avx2`. On a CPU whose own path is AVX2 already (no AVX-512, AMX or AVX-VNNI), the suite's own
run of those tests was this run: it is skipped, saying so (PIPELINE_TEST_CAP_ANYWAY=1 runs it
there all the same, to check the mechanism)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import PY, REPO

KERNEL_PATH = REPO / "tests" / "kernel_path"
# The cap, for every process of the capped run (tests/kernel_path/sitecustomize.py reads the first).
CAPPED_ENV = {"PIPELINE_TEST_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# CPU flags of kernel paths wider than AVX2 (torch, oneDNN and vLLM pick kernels by them).
WIDER_THAN_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ne_convert")
CAPPED_RUN_TIMEOUT_S = 3000


def wider_flags() -> list[str]:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return sorted(f for f in set(flags) if f.startswith(WIDER_THAN_AVX2))


def capped_env() -> dict[str, str]:
    """This process's environment with the cap. Nothing of this pytest run leaks in (xdist's
    worker variables, the file where `make test` wants this run's skipped tests), nor a kept e2e
    working dir, made on another kernel path."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))
           and k not in ("PIPELINE_NOT_RUN_FILE", "EAGLE3_E2E_WORKDIR")}
    env.update(CAPPED_ENV, PYTHONPATH=os.pathsep.join(p for p in (str(KERNEL_PATH), env.get("PYTHONPATH")) if p))
    return env


# What a fresh process sees under the cap: torch's kernel level, and the wider flags torch.cpu
# still reports (vLLM picks its CPU kernels by them).
PROBE = ("import json, torch; print(json.dumps([torch.backends.cpu.get_cpu_capability(), sorted(k for k, v in "
         "torch.cpu.get_capabilities().items() if v is True and k.startswith(('avx512', 'amx')))]))")


def capped_run(basetemp: Path, results: Path, *args: str) -> subprocess.CompletedProcess:
    """`pytest tests -m numerics` with every process capped to AVX2; its figures and outcomes
    in `results` (tests/conftest.py writes them there)."""
    cmd = [PY, "-m", "pytest", str(REPO / "tests"), "-m", "numerics", "-n", "0", "-p", "no:cacheprovider",
           "--basetemp", str(basetemp), "--timeout", "1200", "-q", "-rfE", "--durations=5", *args]
    return subprocess.run(cmd, cwd=REPO, env={**capped_env(), "PIPELINE_TEST_FIGURES_FILE": str(results)},
                          capture_output=True, text=True, timeout=CAPPED_RUN_TIMEOUT_S)


@pytest.mark.timeout(CAPPED_RUN_TIMEOUT_S + 60)
def test_numerics_tests_pass_with_the_cpu_kernels_capped_to_avx2(request, tmp_path, record_property):
    wider = wider_flags()
    if not wider and not os.environ.get("PIPELINE_TEST_CAP_ANYWAY"):
        pytest.skip("this CPU's own kernel path is AVX2 (no AVX-512, AMX or AVX-VNNI flag): the numerics tests "
                    "run on it in the suite itself, so a run capped to AVX2 would repeat them")
    # The cap holds in a fresh process (as in every process of the run below): torch at AVX2,
    # no AVX-512 or AMX flag left for vLLM to pick kernels by.
    probe = subprocess.run([PY, "-c", PROBE], env=capped_env(), capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert json.loads(probe.stdout.splitlines()[-1]) == ["AVX2", []], (wider, probe.stdout)
    results = tmp_path / "results.json"
    proc = capped_run(tmp_path / "tmp", results)
    out = proc.stdout + proc.stderr
    (tmp_path / "pytest.log").write_text(out)
    ran = (json.loads(results.read_text()) if results.exists()
           else {"figures": [], "selected": [], "passed": [], "not_passed": []})
    for row in ran["figures"]:
        record_property("figures", row)  # printed with this run's own figures
    # Its slowest phases and its result line, printed at the end of this run.
    lines = [line for line in out.splitlines() if re.match(r"\d+\.\d+s (setup|call|teardown) ", line)]
    lines += [line for line in out.splitlines() if line.strip()][-1:]
    record_property("capped_run", f"CPU flags capped away: {' '.join(wider) or '(none)'}; "
                                  f"log: {tmp_path / 'pytest.log'}\n" + "\n".join(lines))
    assert proc.returncode == 0, f"the numerics tests capped to AVX2 failed ({proc.returncode}):\n{out[-12000:]}"
    # It ran every numerics test (all this session collected among them) and each passed, every
    # figure on the capped path.
    numerics = {item.nodeid for item in request.session.items if item.get_closest_marker("numerics")}
    assert ran["selected"] and set(ran["selected"]) == set(ran["passed"]) >= numerics, ran
    assert not ran["not_passed"], ran["not_passed"]
    assert ran["figures"] and {row["kernel_path"] for row in ran["figures"]} == {"capped to avx2"}, ran["figures"]
