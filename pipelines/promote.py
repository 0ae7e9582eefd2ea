"""Promote a registered reward model: move the MLflow registry alias `champion` to a version that passes

The same as `anchor-rm promote`; the code is anchor_rm/cli/promote.py. `python pipelines/promote.py --help` lists the options.
"""

import sys

from anchor_rm.cli.promote import main

if __name__ == "__main__":
    sys.exit(main())
