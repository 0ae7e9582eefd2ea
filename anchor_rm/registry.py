"""Kept for versions registered before models from code (anchor_rm/mlflow_edge/pyfunc_model.py): their pickled
python_model names the class `anchor_rm.registry.RewardModelPyfunc` (tests/test_packaging.py loads one). Versions
registered since carry their code and pickle nothing. New code imports anchor_rm.mlflow_edge.registry and
anchor_rm.mlflow_edge.model_package."""

from anchor_rm.mlflow_edge.model_package import RewardModelPyfunc  # noqa: F401
