"""Promote a registered reward model: move the MLflow registry alias `champion` to a version that passes
the promotion gates, or roll `champion` back to the version it replaced.

    python pipelines/promote.py                        # judge the version holding `challenger`, promote if it passes
    python pipelines/promote.py --version 3 --dry-run  # print the comparison and the decision; move nothing
    python pipelines/promote.py --max-id-drop 1.0      # a stricter ID gate
    python pipelines/promote.py --version 3 --force    # promote even though gates fail (still needs a report)
    python pipelines/promote.py --rollback             # champion back to previous-champion
    python pipelines/promote.py --check [--repair]     # list (and remove) versions left half-made
    python pipelines/promote.py --tracking-uri http://127.0.0.1:5000 --name anchor-rm-harmless

Every version registered by pipelines/tune.py carries its evaluation report; promotion reads it and the
current champion's, prints them side by side (on validation: mean OOD NTS, WRG, ID accuracy, the teacher's
ID accuracy; on test: the same and AOG per OOD target; pairs per split) and one PASS/FAIL line per gate.
The gates read the validation rows only: promoting on test again and again would select on test, and the
test figures, kept for the report, would then overstate the champion.

    validation rows     the candidate's report has validation rows (reports written since 2026-12-01)
    validation splits   on the same validation data as the champion's
    mean OOD NTS (val)  the candidate's validation mean OOD NTS is not below the champion's
    ID accuracy (val)   the candidate's validation ID accuracy is at most --max-id-drop points below the
                        weak teacher's (the first promotion, with no champion yet, is judged on this gate
                        and the first)

A promotion points `previous-champion` at the old champion and `champion` at the new version, and tags
the version promoted_at / promoted_from. Registry stages are not used. The only deletion is --check
--repair's: a version without its report, run tag or description (left by a registration killed midway
whose cleanup could not reach the store) that no alias names.
A version without a report (or with figures on other than the test splits) is never promoted.

exit status:
    0  promoted (with --dry-run: would be promoted), already champion, or rolled back
    1  a gate refused the version; nothing moved
    2  bad input: unknown model or version, no version holds `challenger`, the version has no report,
       nothing to roll back to, an unreachable tracking store
    3  another promotion or rollback moved `champion` right after this one set it: this one did not stick;
       the aliases printed are the final ones (MLflow has no atomic alias update: see anchor_rm/pipeline/promotion.py)
"""

from __future__ import annotations

import argparse
import os
import sys

from anchor_rm.cli.common import clean_errors, setup_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", help="registered model name (default: anchor-rm-<category>, i.e. anchor-rm-harmless, "
                                  "what the default main job registers)")
    p.add_argument("--category", choices=["helpful", "harmless"], default="harmless",
                   help="picks the default --name: anchor-rm-harmless (default) or anchor-rm-helpful")
    p.add_argument("--version", help="the version to promote (default: the version holding the alias 'challenger', "
                                     "which pipelines/tune.py sets on every version it registers)")
    p.add_argument("--max-id-drop", type=float, default=2.0, metavar="POINTS",
                   help="ID gate: the candidate's validation ID accuracy may be at most this many points below "
                        "the weak teacher's (default 2.0)")
    p.add_argument("--force", action="store_true",
                   help="promote even if gates fail (prints which); a report is still required")
    p.add_argument("--dry-run", action="store_true", help="print the comparison and the decision; move no alias")
    p.add_argument("--rollback", action="store_true",
                   help="move champion back to previous-champion, and previous-champion to the version rolled "
                        "back from (a second --rollback undoes the first); no gates")
    p.add_argument("--check", action="store_true",
                   help="list the versions without a complete registration (report, run tag, description); "
                        "exit 1 if there are any")
    p.add_argument("--repair", action="store_true",
                   help="with --check: delete those versions, except one an alias names (that one is listed)")
    p.add_argument("--tracking-uri",
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)")
    p.add_argument("--settle-seconds", type=float, default=1.0,
                   help="wait this long after moving the alias before reading it back to detect a concurrent "
                        "promotion (default 1.0)")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rollback and (args.version or args.force):
        parser.error("--rollback takes no --version or --force: it moves champion back to previous-champion")
    if args.repair and not args.check:
        parser.error("--repair needs --check")
    if args.check and (args.rollback or args.version or args.force):
        parser.error("--check takes no --rollback, --version or --force")
    if not 0 <= args.settle_seconds < float("inf"):  # nan fails both comparisons
        parser.error(f"--settle-seconds must be a finite number of seconds >= 0, got {args.settle_seconds}")
    setup_logging(args.verbose)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with clean_errors():
        from anchor_rm.mlflow_edge import store
        from anchor_rm.mlflow_edge.registry import default_model_name
        from anchor_rm.pipeline import promotion, promotion_text

        name = args.name or default_model_name(args.category)
        try:
            uri = store.connect(args.tracking_uri, must_exist=True)
            print(f"tracking store: {uri}")
            if args.check:
                return check_versions(name, args.repair)
            if args.rollback:
                result = promotion.rollback(name, dry_run=args.dry_run, settle_seconds=args.settle_seconds)
                print(promotion_text.format_rollback(result))
                return promotion_text.exit_code(result.status)
            decision = promotion.decide(name, args.version, max_id_drop=args.max_id_drop)
            print(promotion_text.format_decision(decision))
            print()
            if args.dry_run:
                result = promotion.preview(decision, force=args.force)
            else:
                result = promotion.apply_promotion(decision, force=args.force, settle_seconds=args.settle_seconds)
            if result.decision is not decision:  # the champion moved before writing: show the new comparison
                print(promotion_text.format_decision(result.decision))
                print()
            print(promotion_text.format_result(result))
            return promotion_text.exit_code(result.status)
        except store.TrackingError as exc:  # an unreachable server or a store error: one line, not a traceback
            if os.environ.get("ANCHOR_RM_DEBUG"):
                raise
            print(f"error: MLflow: {store.message(exc)}", file=sys.stderr)
            return 2


def check_versions(name: str, repair: bool) -> int:
    """--check [--repair]: 0 when every version is complete (or was repaired), 1 when some are not."""
    from anchor_rm.mlflow_edge import registry

    incomplete = registry.incomplete_versions(name)
    named = {version: alias for alias, version in registry.read_aliases(name).items()}
    if not incomplete:
        print(f"{name}: every version is complete")
        return 0
    left = 0
    for version, missing in incomplete:
        if repair and version not in named:
            registry.delete_version(name, version)
            print(f"v{version}: missing {missing}: deleted")
        else:
            left += 1
            keep = f" (kept: alias {named[version]} names it)" if version in named else ""
            print(f"v{version}: missing {missing}{keep}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
