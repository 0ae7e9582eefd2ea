"""MLflow bookkeeping around Tune trials: one child run per trial, found again rather than duplicated, and
closed with the trial's real outcome (finished, stopped early by ASHA, or failed)."""

from __future__ import annotations

import logging

from mlflow.entities import RunStatus
from mlflow.tracking import MlflowClient
from ray.tune import Callback

log = logging.getLogger("anchor_rm")

TRIAL_TAG = "anchor_rm.trial_id"
PARENT_TAG = "mlflow.parentRunId"


def find_child_run(client: MlflowClient, experiment_id: str, parent_run_id: str, trial_id: str) -> str | None:
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}' and tags.`{TRIAL_TAG}` = '{trial_id}'",
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def child_run_for_trial(payload, trial_id: str, trial_name: str, train_cfg) -> str:
    """The trial's MLflow run: created on its first start, reused when the trial restarts or resumes."""
    client = MlflowClient(payload.tracking_uri)
    run_id = find_child_run(client, payload.experiment_id, payload.parent_run_id, trial_id)
    if run_id is not None:
        client.update_run(run_id, status="RUNNING")
        return run_id
    tags = {PARENT_TAG: payload.parent_run_id, TRIAL_TAG: trial_id, "mlflow.runName": trial_name,
            "anchor_rm.stage": "trial", "anchor_rm.method": train_cfg.method, **payload.tags}
    run = client.create_run(payload.experiment_id, tags=tags)
    params = {f"train.{k}": str(v) for k, v in train_cfg.to_dict().items()}
    params.update({"student": payload.cfg.student, "teacher": payload.cfg.teacher, "num_workers": str(payload.num_workers)})
    from mlflow.entities import Param

    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in params.items()])
    return run.info.run_id


class MlflowTrialStatus(Callback):
    """Closes each trial's MLflow run when Tune is done with the trial.

    A trial stopped by ASHA ends its Tune function abruptly, so the run would otherwise stay RUNNING.
    """

    def __init__(self, tracking_uri: str, experiment_id: str, parent_run_id: str):
        self.tracking_uri = tracking_uri
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id

    def _close(self, trial, status: str, note: str) -> None:
        try:
            client = MlflowClient(self.tracking_uri)
            run_id = find_child_run(client, self.experiment_id, self.parent_run_id, trial.trial_id)
            if run_id is None:
                return
            client.set_tag(run_id, "anchor_rm.trial_outcome", note[:5000])
            client.set_terminated(run_id, status=status)
        except Exception as exc:  # the tracking server may be the failure: say so, and let Tune carry on
            log.error("trial %s: could not mark its MLflow run %s (%s): %s", trial.trial_id, status, note[:300],
                      str(exc).splitlines()[0][:300])

    def on_trial_complete(self, iteration, trials, trial, **info):
        epochs = (trial.last_result or {}).get("training_iteration", 0)
        self._close(trial, RunStatus.to_string(RunStatus.FINISHED), f"completed after {epochs} epoch(s)")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._close(trial, RunStatus.to_string(RunStatus.FAILED), f"failed: {error_summary(trial)}")


def error_summary(trial) -> str:
    """The last line of the trial's error (the exception itself), and where Ray keeps the full trace."""
    error = trial.get_error()
    lines = [line.strip() for line in str(error or "").splitlines() if line.strip()]
    last = lines[-1] if lines else "unknown error"
    return f"{last} (full trace: {trial.error_file})" if trial.error_file else last


class ProgressLog(Callback):
    """One line per reported epoch and per finished trial, for a terminal without Tune's tables."""

    def on_trial_result(self, iteration, trials, trial, result, **info):
        done = sum(t.status in ("TERMINATED", "ERROR") for t in trials)
        log.info("trial %s epoch %s: val mean NTS %+.2f, val ID acc %.1f  [%d/%d trials done]",
                 trial.trial_id, result.get("epoch"), result.get("val_mean_nts", float("nan")),
                 result.get("val_id_acc", float("nan")), done, len(trials))

    def on_trial_complete(self, iteration, trials, trial, **info):
        import ray

        cfg = trial.config
        log.info("trial %s finished: method=%s lambda=%s layers=%s", trial.trial_id, cfg.get("method"),
                 cfg.get("anchor_lambda"), cfg.get("anchor_layers"))
        log.debug("cluster resources free: %s", ray.available_resources())
