"""Layer 7, the command line: `anchor-rm tune|train|evaluate|promote|study` (main.py) and the scripts under
pipelines/, which call the same `main` functions. The one layer that parses arguments and prints; it may import
every layer below and the Ray edge (tuning/)."""
