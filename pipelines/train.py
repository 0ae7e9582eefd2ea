"""Train one weak-to-strong reward model and evaluate it ID and OOD, recorded in MLflow.

The same as `anchor-rm train`; the code is anchor_rm/cli/train.py. `python pipelines/train.py --help` lists the options.
"""

import sys

from anchor_rm.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
