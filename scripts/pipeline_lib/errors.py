"""Errors a user can act on, and the entry-point wrapper that prints them cleanly."""
from __future__ import annotations

import sys
import traceback
from typing import Callable

from .secrets import scrub


class PipelineError(Exception):
    """Bad input or an unmet contract. The message names the file, row or setting and what
    to do; scripts exit with status 2 and print only the message (no traceback)."""


def run_main(main: Callable[[], object]) -> None:
    # Messages and tracebacks can quote inputs (paths, settings, a server's reply): they reach
    # the job's log only after secrets are scrubbed from them.
    try:
        result = main()
    except PipelineError as err:
        print(f"ERROR: {scrub(str(err))}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception:
        print(scrub(traceback.format_exc()), file=sys.stderr, end="", flush=True)
        sys.exit(1)
    sys.exit(result if isinstance(result, int) else 0)
