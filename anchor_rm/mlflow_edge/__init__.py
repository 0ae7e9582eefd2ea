"""Layer 5, the MLflow edge: the only part of the library that imports mlflow. Imports the layers below it.

    store           connecting to a tracking store and registry; MLflow's errors as one type
    runs            runs and stage runs: start, tag, log, stage caching keyed on content, the metric sinks
    writer          the buffered, outage-tolerant metric writer Ray trials log through
    model_package   the registered model's layout: the pyfunc wrapper, the reward model and report inside
                    it, and resolving models:/ and runs:/ URIs to a local folder
    pyfunc_model    the registered model's code (MLflow models from code)
    registry        registering a version with its report, reading it back, aliases and version tags

The names it writes (tags, aliases, artifacts, metrics) are anchor_rm/evaluation/keys.py: pure, shared by the
sinks below this layer. This package imports nothing at package level.
"""
