"""MLflow bookkeeping around Tune trials: one child run per trial, found again rather than duplicated, and
closed with the trial's real outcome (finished, stopped early by ASHA, or failed)."""

from __future__ import annotations

import logging

from ray.tune import Callback

from anchor_rm.evaluation import keys
from anchor_rm.mlflow_edge import runs

log = logging.getLogger("anchor_rm")


def child_run_for_trial(payload, trial_id: str, trial_name: str, train_cfg) -> str:
    """The trial's MLflow run: created on its first start, reused when the trial restarts or resumes."""
    params = {f"train.{k}": str(v) for k, v in train_cfg.to_dict().items()}
    params.update({"student": payload.cfg.student, "teacher": payload.cfg.teacher, "num_workers": str(payload.num_workers)})
    return runs.trial_run(payload.tracking_uri, payload.experiment_id, payload.parent_run_id, trial_id, trial_name,
                          tags={keys.METHOD_TAG: train_cfg.method, **payload.tags}, params=params)


class MlflowTrialStatus(Callback):
    """Closes each trial's MLflow run when Tune is done with the trial.

    A trial stopped by ASHA ends its Tune function abruptly, so the run would otherwise stay RUNNING.
    """

    def __init__(self, tracking_uri: str, experiment_id: str, parent_run_id: str):
        self.tracking_uri = tracking_uri
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id

    def _close(self, trial, failed: bool, note: str) -> None:
        status = "FAILED" if failed else "FINISHED"
        try:
            run_id = runs.find_trial_run(self.tracking_uri, self.experiment_id, self.parent_run_id, trial.trial_id)
            if run_id is None:
                return
            runs.end_run(self.tracking_uri, run_id, failed, note)
        except Exception as exc:  # the tracking server may be the failure: say so, and let Tune carry on
            log.error("trial %s: could not mark its MLflow run %s (%s): %s", trial.trial_id, status, note[:300],
                      str(exc).splitlines()[0][:300])

    def on_trial_complete(self, iteration, trials, trial, **info):
        epochs = (trial.last_result or {}).get("training_iteration", 0)
        self._close(trial, False, f"completed after {epochs} epoch(s)")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._close(trial, True, f"failed: {error_summary(trial)}")


def error_summary(trial) -> str:
    """The last line of the trial's error (the exception itself), and where Ray keeps the full trace."""
    error = trial.get_error()
    lines = [line.strip() for line in str(error or "").splitlines() if line.strip()]
    last = lines[-1] if lines else "unknown error"
    return f"{last} (full trace: {trial.error_file})" if trial.error_file else last


class ProgressLog(Callback):
    """One line per started trial, per reported epoch and per finished trial, for a terminal without Tune's
    tables."""

    def on_trial_start(self, iteration, trials, trial, **info):
        cfg = trial.config
        log.info("trial %s started: method=%s lambda=%s layers=%s", trial.trial_id, cfg.get("method"),
                 cfg.get("anchor_lambda"), cfg.get("anchor_layers"))

    def on_trial_result(self, iteration, trials, trial, result, **info):
        done = sum(t.status in ("TERMINATED", "ERROR") for t in trials)
        log.info("trial %s epoch %s: val mean NTS %+.2f, val ID acc %.1f  [%d/%d trials done]",
                 trial.trial_id, result.get("epoch"), result.get("val_mean_nts", float("nan")),
                 result.get("val_id_acc", float("nan")), done, len(trials))

    def on_trial_error(self, iteration, trials, trial, **info):
        log.warning("trial %s failed: %s", trial.trial_id, error_summary(trial))

    def on_trial_complete(self, iteration, trials, trial, **info):
        import ray

        cfg = trial.config
        log.info("trial %s finished: method=%s lambda=%s layers=%s", trial.trial_id, cfg.get("method"),
                 cfg.get("anchor_lambda"), cfg.get("anchor_layers"))
        log.debug("cluster resources free: %s", ray.available_resources())
