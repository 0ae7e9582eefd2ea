"""The MLflow edge: the only part of the library that imports mlflow.

    keys            every tag, alias, artifact and metric name, and the functions that build metric dicts
                    (pure: importing it imports no mlflow)
    store           connecting to a tracking store and registry; MLflow's errors as one type
    runs            runs and stage runs: start, tag, log, stage caching keyed on content, the metric sinks
    writer          the buffered, outage-tolerant metric writer Ray trials log through
    model_package   the registered model's layout: the pyfunc wrapper, the reward model and report inside
                    it, and resolving models:/ and runs:/ URIs to a local folder
    registry        registering a version with its report, reading it back, aliases and version tags

This package imports nothing at package level, so `anchor_rm.mlflow_edge.keys` stays free of mlflow.
"""
