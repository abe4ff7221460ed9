"""Acceptance of an EAGLE-3 draft: how many drafted tokens the target accepts under greedy
speculative decoding, measured by a backend picked from BACKENDS.

Interchangeable backends, one module each, registered in BACKENDS (name -> Backend, three
functions `(spec, engine_script=...)`): `no_draft`, the target alone, measured once by the
acceptance_baseline job for every variant with the same BASELINE_KEYS settings (baseline.py:
the file; greedy outputs, nothing timed), `drafts`, the trained and untrained drafts of one
variant (acceptance job), and `speedup`, interleaved timed rounds without and with the trained
draft in that same job (speedup.py: the ratio, its interval, or why it is not measured):

  vllm          vllm_backend.py: real vLLM serves the target with the draft as its EAGLE-3
                speculator (engine counters + per-request verify steps)
  transformers  transformers_backend.py: exact greedy acceptance in batched transformers
                passes (batched.py), self-checked against step-by-step chain speculation
                (chain.py); no vLLM needed

Shared code: job.py (settings, prompts and spec of both jobs), inputs.py (eval prompts, MeasureSpec), records.py (per-request verify steps ->
numbers, greedy equality, the registry), summary.py (the acceptance.json body), speedup.py (the speedup rounds and their decision), draft.py (the
EAGLE-3 draft run as at inference). Every backend produces the same per-request step records,
so the outputs have one schema.
"""
from . import transformers_backend, vllm_backend  # noqa: F401  (each registers its backend)
from .inputs import (DEFAULT_REASONING_END, REASONING_END_MARKERS, EvalPrompt, MeasureSpec,  # noqa: F401
                     answer_room, load_eval_prompts, reasoning_end_token_id)
from .baseline import baseline_body, load_baseline  # noqa: F401
from .job import BASELINE_KEYS, effective_settings, eos_token_ids, measure_spec, suite_files, suite_of  # noqa: F401
from .records import (BACKENDS, Backend, BackendFailure, RequestRecord, RunResult, acceptance_block,  # noqa: F401
                      greedy_equality, per_category, per_span, register, request_steps, request_summaries,
                      step_span, steps_block)
from .speedup import decide, run_rounds, throughput  # noqa: F401
from .summary import assemble  # noqa: F401
from .vllm_backend import run_engine_job, vllm_root_cause  # noqa: F401
