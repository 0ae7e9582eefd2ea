"""Evaluate a reward model on preference data and write the report (JSON, Markdown, PNG).

The same as `anchor-rm evaluate`; the code is anchor_rm/cli/evaluate.py. `python pipelines/evaluate.py --help` lists the options.
"""

import sys

from anchor_rm.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
