"""Prompt sets as chat messages (stage 2, scripts/prepare_prompts.py; and the eval suites that
verification measures), one concern per module:

  formats.py          raw row -> Prompt, per source format (FORMATS: sharegpt, messages, ...)
  sources.py          which file or hub dataset a setting names, and loading its rows
  json_list.py        a JSON list read record by record (a file cut off mid-record included)
  decontamination.py  the n-gram test that keeps eval prompts out of training
  mix.py              de-duplication, train/eval split, caps, weighted mixes; the rows written
"""
from .decontamination import Decontamination, ngrams, prompt_texts  # noqa: F401
from .formats import CODEIO_INSTRUCTION, FORMATS, Counts, Prompt, RawRow  # noqa: F401
from .mix import HELD_OUT_CATEGORY, build_split, input_files, load_sources, rows_of, split_specs  # noqa: F401
from .sources import (FILE_SUFFIXES, SYNTHESIZED, SourceSpec, file_suffix, load_prompts, maybe_hub,  # noqa: F401
                      resolve_synthesized)
