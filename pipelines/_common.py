"""Shared command-line plumbing for the pipelines: logging, quiet third-party output, clean errors."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager

# Nothing may reach the hub at run time on an offline machine; users with a network can unset this.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    for noisy in ("mlflow", "alembic", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


@contextmanager
def clean_errors():
    """Bad input ends the program with one line naming what is wrong, not a library traceback
    (ANCHOR_RM_DEBUG=1 shows the traceback)."""
    from anchor_rm.data import DataError
    from anchor_rm.models import ModelError

    try:
        yield
    except (DataError, ModelError, ValueError, FileNotFoundError) as exc:
        if os.environ.get("ANCHOR_RM_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
