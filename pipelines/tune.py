"""The main job: the whole weak-to-strong protocol on Ray, tracked in MLflow, ending in a registered model.

The same as `anchor-rm tune`; the code is anchor_rm/cli/tune.py. `python pipelines/tune.py --help` lists the options.
"""

import sys

from anchor_rm.cli.tune import main

if __name__ == "__main__":
    sys.exit(main())
