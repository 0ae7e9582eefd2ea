"""`anchor-rm COMMAND [ARGS]`: the console entry point pip installs (pyproject.toml, [project.scripts]).

    anchor-rm tune                  # the main job (the same as python pipelines/tune.py)
    anchor-rm train --method naive  # one student, tracked in MLflow
    anchor-rm evaluate --model models:/anchor-rm-harmless@champion --data xstest-overrefusal
    anchor-rm promote --check
    anchor-rm study --seeds 0,1,2

Each command's module is imported only when it runs, so that `anchor-rm --help` and `anchor-rm promote` do not
pay for importing torch or Ray.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "tune": "the main job: data, teacher, ceiling, baselines and the Ray Tune search; registers the selected model",
    "train": "one student (or teacher, ceiling, baseline) with the protocol's data, tracked in MLflow",
    "evaluate": "score a model (registered, a run's or a folder) on preference sets; OOD report",
    "promote": "move the champion alias to a challenger that beats it on validation",
    "study": "many seeds of every method; paired comparisons with intervals",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    return ("usage: anchor-rm COMMAND [ARGS]   (anchor-rm COMMAND --help for a command's options)\n\ncommands:\n"
            + "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        from importlib.metadata import version

        print(f"anchor-rm {version('anchor-rm')}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"anchor-rm: unknown command {command!r}; one of {', '.join(COMMANDS)}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv[0] = f"anchor-rm {command}"  # argparse names the program after it in usage lines and errors
    module = importlib.import_module(f"anchor_rm.cli.{command}")
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
