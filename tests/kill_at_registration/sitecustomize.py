"""A fault for tests/test_tune.py, loaded by the Python processes it starts with this folder on PYTHONPATH.

When ANCHOR_RM_TEST_KILL_AT_REGISTRATION names a file that does not exist yet, the process creates that file
and SIGKILLs itself the first time it updates a model version in MLflow: right after the registry created
the version (`register_model`) and before its description, run tag and alias. Nothing in the project reads
this variable; without it (or once the file exists) this module does nothing.
"""

import os
import signal

_MARKER = os.environ.get("ANCHOR_RM_TEST_KILL_AT_REGISTRATION")

if _MARKER and not os.path.exists(_MARKER):
    from mlflow.tracking import MlflowClient

    _update = MlflowClient.update_model_version

    def _killed_at_registration(self, *args, **kwargs):
        if not os.path.exists(_MARKER):
            with open(_MARKER, "w") as marker:
                marker.write(f"{os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return _update(self, *args, **kwargs)

    MlflowClient.update_model_version = _killed_at_registration
