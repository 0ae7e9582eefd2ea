"""Kept for versions registered before the MLflow edge moved to anchor_rm/mlflow_edge/: their pickled
python_model names the class `anchor_rm.registry.RewardModelPyfunc`. New code imports
anchor_rm.mlflow_edge.registry and anchor_rm.mlflow_edge.model_package."""

from anchor_rm.mlflow_edge.model_package import RewardModelPyfunc  # noqa: F401
