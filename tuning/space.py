"""What Ray Tune searches, how, and what it maximises.

The objective is the mean NTS over the OOD targets on the *validation* splits, reported every epoch so that
ASHA can stop weak trials early. Test splits never reach the search.
"""

from __future__ import annotations

import functools

from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch

METRIC = "val_mean_nts"
MODE = "max"
DRIFT_RESULT = "val_drift_last"  # each trial's last-layer drift on the drift probe (drift.DriftProbe), per epoch
LAYER_CHOICES = ("last", "middle")


def anchor_search_space(trial, ranges: dict) -> dict:
    """Optuna define-by-run space: the layer choice (last or middle), then lambda log-uniform over that choice's
    range (`ranges`: layer choice -> (low, high), lambda_scale.LambdaRange.ranges: calibrated for the student, since
    lambda does not carry across models). Each choice's lambda is its own Optuna parameter, so that the sampler
    never mixes the two scales.

    lambda = 0 is not in it: that is naive W2S, which the baselines train once, and with lambda = 0 the layer
    choice changes nothing, so a lambda-0 trial would train the same model again (two or three of the five
    students of a default run did). The selection compares the search's trials with naive W2S explicitly
    (search.select)."""
    layers = trial.suggest_categorical("anchor_layers", list(LAYER_CHOICES))
    lam = trial.suggest_float(f"anchor_lambda_{layers}", *ranges[layers], log=True)
    return {"method": "anchor", "anchor_lambda": lam, "anchor_layers": layers}


def make_searcher(seed: int, ranges: dict) -> OptunaSearch:
    return OptunaSearch(space=functools.partial(anchor_search_space, ranges={k: tuple(v) for k, v in ranges.items()}),
                        metric=METRIC, mode=MODE, seed=seed)


def make_scheduler(max_epochs: int) -> ASHAScheduler:
    """Stops a trial after an epoch when its validation NTS is in the bottom half of its rung."""
    return ASHAScheduler(time_attr="training_iteration", metric=METRIC, mode=MODE, max_t=max_epochs,
                         grace_period=1, reduction_factor=2)


def trial_method_config(config: dict) -> dict:
    """The TrainConfig fields a trial config sets (Optuna's bookkeeping keys left out)."""
    keys = ("method", "anchor_lambda", "anchor_layers", "confidence_alpha")
    return {k: config[k] for k in keys if k in config}
