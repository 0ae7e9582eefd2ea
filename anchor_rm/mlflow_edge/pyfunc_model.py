"""The registered model's code (MLflow "models from code"): `log_pyfunc` logs this file as the model's
python_model and the anchor_rm package as its code_paths, so that MLflow's own tools (`mlflow models serve`,
`--env-manager virtualenv`, `mlflow models build-docker`) load a version from its folder and its requirements
alone, with no anchor-rm installed. Nothing is pickled: the class is read from the code that ships with it."""

import mlflow

from anchor_rm.mlflow_edge.model_package import RewardModelPyfunc

mlflow.models.set_model(RewardModelPyfunc())
