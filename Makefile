# The two commands a newcomer needs:
#   make demo   build the environment (first time: a few minutes), then run the whole
#               pipeline on the demo default (config.yaml) -> results/smollm2-135m-demo/
#   make test   same environment, then the test suite as this user; at the end it names the tests
#               that need root and did not run, and `sudo make test-root` runs them (CI runs all)
VENV ?= .venv
PY := $(VENV)/bin/python
SNAKEMAKE := $(VENV)/bin/snakemake
CORES ?= 2
PYTEST_ARGS ?=
# Rules call `python`: make it the venv's.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: env lock slurm demo unlock test test-root test-portable lint dry-run plan check-provenance docs

env:
	@bash scripts/setup_env.sh $(VENV)

# After editing envs/cpu.txt: pin the whole CPU stack again (envs/cpu.lock, what `make env` installs).
lock:
	@bash scripts/lock_env.sh

demo: env
	@echo "[demo] running the pipeline on config.yaml (see README for what it builds)"
	@echo "$(SNAKEMAKE) --profile profiles/default --cores $(CORES)"
	@$(SNAKEMAKE) --profile profiles/default --cores $(CORES) || { status=$$?; \
	  if ls .snakemake/locks/*.lock >/dev/null 2>&1; then echo "$$LOCK_HINT" >&2; fi; exit $$status; }

# Removes a lock left by a killed run (see LOCK_HINT: only when no run is active here).
unlock: env
	$(SNAKEMAKE) --profile profiles/default --unlock

# Printed by `make demo` when it failed and a Snakemake lock is present (docs/faults.md: The lock).
define LOCK_HINT
[demo] Snakemake's lock stopped this run (.snakemake/locks): another snakemake run is working in
[demo] this directory, or one was killed (kill -9, a closed session, a crashed node) and left its lock.
[demo]  - Still running? Check `pgrep -af snakemake` (on a cluster also its jobs: `squeue -u $$USER`).
[demo]    Wait for it or stop it; never unlock under a live run: both would write the same files.
[demo]  - None running: `make unlock` (snakemake --unlock) removes the stale lock; then `make demo`
[demo]    again. Finished artifacts are kept; jobs the killed run left incomplete run again.
endef
export LOCK_HINT

# The cluster-profile test runs a real single-node SLURM: Debian packages, installed once (root).
slurm:
	@bash .ci/install_slurm.sh

# Tests that need root: the SLURM cluster test (it starts slurmctld, slurmd, munged, slurmdbd and
# MariaDB and writes /etc/slurm) and the full-disk tests (they mount a small tmpfs); and one that
# needs only SLURM's scontrol; marked needs_root at collection (tests/conftest.py).
# ROOT_TESTS=auto (the default): `make test` installs SLURM where it runs as root with apt, runs
# those tests where they can run, and skips them elsewhere, naming them at the end with their
# count and the command that runs them.
# ROOT_TESTS=require (CI, and wherever CI=true): SLURM must install and those tests must run; one
# that cannot fails.
ROOT_TESTS ?= $(if $(filter true,$(CI)),require,auto)

# Two test workers (pytest-xdist), one unit at a time each: a test file, or the tests that use the
# shared e2e run, as one unit, so that run is built once (tests/conftest.py). Most of a test's time
# is one process on one core (Python and Snakemake start-up, a one-thread vLLM engine), so two at
# once keep both cores busy. The numerics tests' second run, with the CPU kernels capped to AVX2,
# is one test of the suite (tests/test_portable_numerics.py), started right away on the worker
# that does not build the e2e run. TEST_WORKERS=0: one process.
# --timeout: a test that hangs fails after 20 minutes instead of holding the run.
# SLURM (apt: downloads and dpkg) installs while the environment builds (pip: mostly CPU), not after it.
TEST_WORKERS ?= 2
test:
	@slurm_log=$$(mktemp); slurm_pid=; \
	if [ "$(ROOT_TESTS)" = require ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }; then \
	  bash .ci/install_slurm.sh > $$slurm_log 2>&1 & slurm_pid=$$!; \
	elif [ "$$(id -u)" != 0 ]; then echo "[test] not root: no SLURM install; the tests that need root are named at the end"; \
	else echo "[test] no apt-get: no SLURM install; if SLURM is missing, its tests are named at the end"; fi; \
	bash scripts/setup_env.sh $(VENV); env_status=$$?; \
	slurm_status=0; if [ -n "$$slurm_pid" ]; then wait $$slurm_pid || slurm_status=$$?; cat $$slurm_log; fi; rm -f $$slurm_log; \
	[ $$env_status = 0 ] || exit $$env_status; \
	if [ $$slurm_status != 0 ]; then \
	  if [ "$(ROOT_TESTS)" = require ]; then exit $$slurm_status; fi; \
	  echo "[test] the SLURM install failed: its tests are named at the end"; fi
	@echo "[test] running the test suite (tests/) on $(TEST_WORKERS) workers"
	@not_run=$$(mktemp); \
	echo "$(PY) -m pytest tests -n $(TEST_WORKERS) --no-loadscope-reorder --timeout 1200 $(PYTEST_ARGS)"; \
	PIPELINE_ROOT_TESTS=$(ROOT_TESTS) PIPELINE_NOT_RUN_FILE=$$not_run \
	  $(PY) -m pytest tests -n $(TEST_WORKERS) --no-loadscope-reorder --timeout 1200 $(PYTEST_ARGS); \
	status=$$?; cat $$not_run; rm -f $$not_run; exit $$status

# The tests `make test` could not run as an ordinary user (those that need root), alone:
# `sudo make test-root` after `make test`. Installs SLURM first (apt, once); a test that still
# cannot run fails. No pytest cache or bytecode is written into the checkout as root.
test-root: env slurm
	@echo "[test] the tests that need root: the SLURM cluster and the full disks"
	PIPELINE_ROOT_TESTS=require PYTHONDONTWRITEBYTECODE=1 $(PY) -m pytest tests -m needs_root -n 0 \
	  -p no:cacheprovider --timeout 1200 $(PYTEST_ARGS)

# The tests marked `numerics` (they assert figures of trained drafts, which follow the CPU's
# kernel path: AMX, AVX512-BF16 or AVX2 bf16 matmuls round differently) once more on a narrower
# path than the machine's own: torch, oneDNN and vLLM's CPU kernels all capped to AVX2
# (tests/kernel_path/sitecustomize.py). `make test` runs this as one of its tests; this target
# runs it alone. It ends with the figures those tests compared.
test-portable: env
	@echo "[test] the numerics tests again, CPU kernels capped to AVX2"
	$(PY) -m pytest tests/test_portable_numerics.py -n 0 -rs --timeout 3100 $(PYTEST_ARGS)

lint: env
	$(SNAKEMAKE) --lint

# The plan of config.yaml, or of your own config: make dry-run CONFIG=my-target.yaml (passed as
# --configfile; configs/sizing-8b.yaml and configs/sizing-70b.yaml are worked examples).
CONFIG ?=
CONFIG_ARGS = $(if $(CONFIG),--configfile $(CONFIG))
dry-run: env
	$(SNAKEMAKE) --profile profiles/default -n $(CONFIG_ARGS)

plan: env
	$(SNAKEMAKE) --profile profiles/default plan $(CONFIG_ARGS)


# Verify a finished results tree against the digests its provenance files recorded.
check-provenance: env
	$(PY) scripts/check_provenance.py results/$(or $(RUN),smollm2-135m-demo)

# Regenerate docs/configuration.md (from schemas/config.schema.yaml) and the tables of docs/*.md
# generated from bench/results/; tests/test_docs.py fails while a committed page is stale.
docs: env
	$(PY) scripts/make_docs.py

# Offline bundle for a GPU node without network (docs/offline-bundle.md): vLLM, the pipeline's
# wheels, the assets, the source (and BUNDLE_TARGET) in parts of BUNDLE_PART_SIZE with digests.
# On the node: python3 bundle/offline_bundle.py unpack bundle --dest <dir>. Needs only python3 and pip.
BUNDLE_DIR ?= bundle
BUNDLE_PART_SIZE ?= 55MiB
BUNDLE_TARGET ?=
BUNDLE_ARGS ?=
.PHONY: bundle
bundle:
	python3 scripts/offline_bundle.py pack --out $(BUNDLE_DIR) --part-size $(BUNDLE_PART_SIZE) \
	  --requirements envs/gpu-node.txt --sdist-requirements envs/gpu-node-sdist.txt \
	  --assets envs/assets.txt --sdist-assets envs/assets-sdist.txt --source . \
	  --env VLLM_USE_FLASHINFER_SAMPLER=0 $(if $(BUNDLE_TARGET),--target-dir $(BUNDLE_TARGET)) $(BUNDLE_ARGS)
