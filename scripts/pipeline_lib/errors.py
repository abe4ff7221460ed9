"""Errors a user can act on, and the entry-point wrapper that prints them cleanly."""
from __future__ import annotations

import sys
import traceback
from typing import Callable


class PipelineError(Exception):
    """Bad input or an unmet contract. The message names the file, row or setting and what
    to do; scripts exit with status 2 and print only the message (no traceback)."""


def run_main(main: Callable[[], object]) -> None:
    try:
        result = main()
    except PipelineError as err:
        print(f"ERROR: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    sys.exit(result if isinstance(result, int) else 0)
