"""Prompts the target writes itself (the synthesize stage; the Magpie method, arXiv 2406.08464),
one concern per module:

  settings.py  the `synthesize` config section: what to ask for, how to sample, the filters
  template.py  the target's chat template rendered up to the opening of a user turn
  filters.py   the filters every candidate request passes, in order (FILTERS), each counting
               what it drops; near-duplicates by word n-gram overlap; decontamination
"""
from .filters import FILTERS, FilterContext, apply_filters  # noqa: F401
from .settings import SynthesisSettings  # noqa: F401
from .template import special_token_ids, template_markers, user_turn_prefix  # noqa: F401
