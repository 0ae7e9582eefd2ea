"""Layer 3, evaluation: how a model is judged and recorded. Imports the data and model layers only.

scores.py          accuracy of a reward model on pair sets (SplitScore), the protocol's evaluation sets, report rows
metrics.py         WRG, AOG, NTS, PGR and their standard errors, temperature fitting
report.py          the report record (EvaluationReport, build_report, report_from_dict)
report_checks.py   the schema (report_schema.json), derived metrics and consistency rules every report passes
report_files.py    report.json, report.md, report.png, written atomically
report_summary.py  what a registered version shows of its report (headline tags, description, digests)
premise.py         whether naive weak-to-strong training shows the failure ANCHOR targets
keys.py            every metric, tag, alias and artifact name (pure): the vocabulary trackers and sinks share
"""
