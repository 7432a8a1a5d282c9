"""What both command lines (`python -m runtime`, `python -m export`) share: how a command's failure ends the process
(`exit_code`: one line on stderr and the exit status, never a traceback for a user's error) and the TPU fit check
(`compile_for_fit`: every program compiled for the slice, a line per program). export may import this module; the
runtime never imports export.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import UserError
from .extras import missing


def exit_code(command: str, call: Callable[[], int | None], not_written: str = "") -> int:
    """Run a command's `call` and return the process's exit status: its own (0 for None), or where it fails, one line
    `error: ...` on stderr and 2 for bad input (a UserError, or an optional extra not installed: which, and the pip
    command), 1 for a bundle that does not fit its TPU slice (runtime/fit.py's DoesNotFit), 130 when interrupted.
    `not_written` ends the lines of the failures after which nothing was written ("; no bundle was written")."""
    try:
        code = call()
    except ModuleNotFoundError as e:  # an optional extra not installed (fastapi for serve, torch for export): which
        error = missing(e, command)
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: interrupted{not_written}", file=sys.stderr)
        return 130
    except Exception as e:
        from .fit import DoesNotFit  # (numpy and the TPU targets: read only where a command failed)

        if not isinstance(e, DoesNotFit):
            raise
        print(f"error: {e}{not_written}", file=sys.stderr)
        return 1
    return 0 if code is None else code


def compile_for_fit(directory: Path, hbm: float | None, log: logging.Logger, mode: str = "serve",
                    manifest: Any = None, verify: bool = True) -> Any:
    """runtime/fit.py's report for the TPU bundle at `directory` (or about to be written there, `manifest` given):
    every program compiled for its slice with XLA's TPU compiler, a line logged as each is compiled. UserError
    without libtpu (before anything is read), DoesNotFit as soon as a program cannot fit; the caller shows the report
    and then calls fit.check."""
    from . import fit

    fit.check_libtpu()
    return fit.fit(directory, hbm, mode, manifest=manifest, verify=verify,
                   on_compiled=lambda c: log.info("compiled %s in %.1f s", c.key, c.compile_s))
