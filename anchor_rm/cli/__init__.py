"""The command line: `anchor-rm tune|train|evaluate|promote|study` (anchor_rm/cli/main.py) and the scripts under
pipelines/, which call the same `main` functions. The one layer that parses arguments and prints."""
