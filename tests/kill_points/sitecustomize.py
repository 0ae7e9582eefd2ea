"""Faults for the resume tests (tests/test_resume.py, tests/test_tune.py), loaded by the Python processes they
start with this folder on PYTHONPATH. Nothing in the project reads these variables; without them (or once the
marker file exists) this module does nothing.

ANCHOR_RM_TEST_KILL_AT="<point>:<marker file>": when the marker does not exist yet, the process creates it
(writing its pid) and SIGKILLs itself the first time it reaches the point:
- trial-start: Tune has just started a trial (its actor is being created, nothing trained or reported yet);
- trial-complete: Tune has just recorded a finished trial, before the next one starts;
- final-evaluation: the first model of the final evaluation has been scored on the test splits;
- registration: the registry has created the model version, before its description, tags and alias (the first
  update of a model version).

The points in tuning/ are patched when their module is first imported (an import hook), so that loading this
file imports neither Ray nor the project: Ray must be imported after tune.py has chosen its token mode.
"""

import importlib.abc
import importlib.util
import os
import signal
import sys

_POINT, _, _MARKER = os.environ.get("ANCHOR_RM_TEST_KILL_AT", "").partition(":")


def _die_once() -> None:
    try:
        fd = os.open(_MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # only the first time, in any process
        return
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def _after(function):
    def killed_after(*args, **kwargs):
        result = function(*args, **kwargs)
        _die_once()
        return result
    return killed_after


def _patch_callbacks(module) -> None:
    if _POINT == "trial-start":
        module.ProgressLog.on_trial_start = _after(module.ProgressLog.on_trial_start)
    elif _POINT == "trial-complete":
        module.ProgressLog.on_trial_complete = _after(module.ProgressLog.on_trial_complete)


def _patch_final(module) -> None:
    module.evaluate_outcome = _after(module.evaluate_outcome)


_PATCHES = {"trial-start": ("tuning.callbacks", _patch_callbacks), "trial-complete": ("tuning.callbacks", _patch_callbacks),
            "final-evaluation": ("tuning.final", _patch_final)}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds `name` as usual, then patches the module once it has run."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # find it the usual way, once
        spec = importlib.util.find_spec(fullname)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _MARKER and not os.path.exists(_MARKER):
    if _POINT == "registration":
        from mlflow.tracking import MlflowClient

        _update = MlflowClient.update_model_version

        def _killed_at_registration(self, *args, **kwargs):
            _die_once()
            return _update(self, *args, **kwargs)

        MlflowClient.update_model_version = _killed_at_registration
    elif _POINT in _PATCHES:
        sys.meta_path.insert(0, _PatchOnImport(*_PATCHES[_POINT]))
    else:
        raise ValueError(f"ANCHOR_RM_TEST_KILL_AT: unknown point {_POINT!r} (tests/kill_points/sitecustomize.py)")
