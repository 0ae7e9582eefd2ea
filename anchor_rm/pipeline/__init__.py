"""Layer 6, pipeline: the protocol's jobs, tracked through the MLflow edge (layer 5, anchor_rm/mlflow_edge/).

config.py          presets (ProtocolConfig, tune presets)
experiment.py      one experiment's stages (data, teacher, ceiling, baselines, the final report) as MLflow stage runs
study.py           the multi-seed study; study_tables.py and study_report.py its tables and plots
evaluate_any.py    evaluating any model on any preference data (evaluate.py)
promotion.py       the promotion gates and alias moves (promote.py); promotion_text.py what it prints
"""
