"""The preference-shift study: both categories, every method, an ANCHOR lambda sweep per layer choice,

The same as `anchor-rm study`; the code is anchor_rm/cli/study.py. `python pipelines/study.py --help` lists the options.
"""

import sys

from anchor_rm.cli.study import main

if __name__ == "__main__":
    sys.exit(main())
