# The two commands a newcomer needs:
#   make demo   build the environment (first time: a few minutes), then run the whole
#               pipeline on the demo default (config.yaml) -> results/smollm2-135m-demo/
#   make test   same environment plus SLURM (apt, once), then the test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
SNAKEMAKE := $(VENV)/bin/snakemake
CORES ?= 2
PYTEST_ARGS ?=
# Rules call `python`: make it the venv's.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: env slurm demo unlock test test-portable lint dry-run plan check-provenance docs

env:
	@bash scripts/setup_env.sh $(VENV)

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

# Two test workers (pytest-xdist), one test file (or the group of files sharing the e2e run) at a
# time each: most of a test's time is one process on one core (Python and Snakemake start-up, a
# one-thread vLLM engine), so two at once keep both cores busy. TEST_WORKERS=0: one process.
# --timeout: a test that hangs fails after 20 minutes instead of holding the run.
TEST_WORKERS ?= 2
test: env slurm
	@echo "[test] running the test suite (tests/) on $(TEST_WORKERS) workers"
	$(PY) -m pytest tests -n $(TEST_WORKERS) --no-loadscope-reorder --timeout 1200 $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory test-portable

# The tests marked `numerics` (they assert figures of trained drafts, which follow the CPU's
# kernel path: AMX, AVX512-BF16 or AVX2 bf16 matmuls round differently) once more on a narrower
# path than the machine's own: torch, oneDNN and vLLM's CPU kernels all capped to AVX2
# (tests/kernel_path/sitecustomize.py). Each prints the figures it compared at the end.
PORTABLE_ENV := PIPELINE_TEST_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
	PYTHONPATH=$(abspath tests/kernel_path)
test-portable: env
	@echo "[test] the numerics tests again, CPU kernels capped to AVX2"
	$(PORTABLE_ENV) $(PY) -m pytest tests -m numerics -n 0 --timeout 1200 $(PYTEST_ARGS)

lint: env
	$(SNAKEMAKE) --lint

dry-run: env
	$(SNAKEMAKE) --profile profiles/default -n

plan: env
	$(SNAKEMAKE) --profile profiles/default plan


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
