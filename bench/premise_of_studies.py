"""Was the failure ANCHOR targets there at all? The premise check (anchor_rm/evaluation/premise.py) of every instance of
recorded studies, from their study.json alone (not a test; the study's own tables.md carries the same table since
session 30).

    .venv/bin/python bench/premise_of_studies.py docs/results/harmless-full-10-seeds/study.json docs/results/helpful-full-5-seeds/study.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:]) or []
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    from anchor_rm.evaluation.premise import premise_table

    for path in paths:
        try:
            instances = json.loads(Path(path).read_text())["instances"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"error: {path}: not a study.json ({exc})", file=sys.stderr)
            return 2
        by_category: dict[str, list] = {}
        for instance in instances:
            by_category.setdefault(instance["category"], []).append(instance)
        for category, group in by_category.items():
            print(f"## {path}: {category}, student {group[0]['student']}\n")
            print("\n".join(premise_table(group)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
