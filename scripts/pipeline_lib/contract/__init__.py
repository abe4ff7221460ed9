"""The contract between the pipeline's stages and what vLLM's speculators loader expects, checked
on a trained draft before anyone measures or ships it (check_contract.py writes contract.json).

Check families, one module each, registered in CHECKS in report order (base.py: Check, Context,
NotRun, the registry); each family says which draft types (`speculators_model_type`) its checks
apply to, and checks_for(draft_type) picks them:

  config         config.py: config.json as vLLM's loader reads it (type, architectures, version,
                 proposal method, verifier path and architectures, layer config, draft vocab)  all
  aux_layer_ids  layers.py: the target layers the draft reads, as extracted for training         all but mtp
  parallel_drafting parallel.py: trained tokens >= the served k, block size agrees, mask token   peagle, dflash*, dspark, xpress
  hidden_states  hidden_states.py: extracted from this target, read as stored                    all
  weights        weights.py: readable, shapes from the config, finite                            eagle3, peagle, dflash
  vocab_maps     vocab.py: d2t/t2d sizes, ranges and agreement                                   all but mtp
  embeddings     embeddings.py: the draft's embeddings are the target's                          eagle3
  training_data  digests.py: tokenizer and chat-template digests vs the target stage's           all
  serving_render serving.py: training prompts = vLLM's own chat render, token for token          all
(weights.readable and weights.finite apply to every draft type; the draft type is the variant's
train.draft_type, which config.speculators_model_type checks the draft against.)

A new family is one new module: `FAMILY = Family(name, applies_to=...)`, `@FAMILY.check(name)` on
each check, imported below at its place in the report. reference.py compares a draft with a
reference draft side by side (informational, outside the registry).
"""
from . import config, layers, parallel, hidden_states, weights, vocab, embeddings, digests, serving  # noqa: F401  (report order)
from .base import (APPLIES_TO, CHECKS, EVERY_DRAFT_TYPE, Check, Context, Family, NotRun, Weights,  # noqa: F401
                   checks_for, load_draft_config, run_check)
from .reference import compare_reference  # noqa: F401
from .serving import SERVING_RENDER  # noqa: F401
