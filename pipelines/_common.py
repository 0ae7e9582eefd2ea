"""Shared command-line plumbing for the pipelines: logging, quiet third-party output, clean errors.

Kept free of heavy imports so that `--help` and the registry-only scripts (promote.py) start quickly.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager

# Nothing may reach the hub at run time on an offline machine; users with a network can unset this.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Read by transformers when it is first imported: no load reports or progress bars in our output.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def add_precision_argument(parser) -> None:
    # The choices are written here, not imported: --help must not pay for importing torch.
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="forward-pass precision of training and evaluation: auto (default) picks bf16 autocast "
                             "only where the hardware computes bf16 natively and faster (CUDA with bf16, a CPU with "
                             "AVX512-BF16 or AMX) and fp32 everywhere else; the choice is logged and recorded")


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    for noisy in ("mlflow", "alembic", "urllib3", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextmanager
def clean_errors():
    """Bad input ends the program with one line naming what is wrong, not a library traceback
    (ANCHOR_RM_DEBUG=1 shows the traceback). DataError and ModelError are ValueErrors."""
    try:
        yield
    except (ValueError, FileNotFoundError) as exc:
        if os.environ.get("ANCHOR_RM_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:  # disk full, read-only or unwritable folder (artifacts, checkpoints, reports)
        if os.environ.get("ANCHOR_RM_DEBUG"):
            raise
        print(f"error: {os_error_line(exc)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def os_error_line(exc: OSError) -> str:
    """One line naming the path and what the system said ("No space left on device", "Read-only file system")."""
    import shutil

    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        source, target, why = exc.args[0][0]  # copytree gathers one (source, target, reason) per file
        return f"{target}: {why}"
    if exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)
