"""The main job end to end on real components: `ray start --head`, `mlflow server`, tune.py, promote.py,
and the champion loaded back through `models:/NAME@champion`."""


import pandas as pd
import pytest

from helpers import mlflow_server, ray_head, run_pipeline

NAME = "anchor-rm-helpful"


@pytest.mark.slow
def test_tune_smoke_on_a_ray_cluster_and_tracking_server_then_promote_and_load(tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    with mlflow_server(tmp_path) as uri, ray_head(tmp_path) as address:
        args = ["--preset", "smoke", "--ray-address", address, "--tracking-uri", uri,
                "--storage-path", str(tmp_path / "ray"), "--name", "smoke-it"]
        result = run_pipeline("tune.py", *args, cwd=tmp_path, timeout=1200)
        assert result.returncode == 0, result.stderr[-4000:]
        assert f"registered: models:/{NAME}/1 (alias challenger)" in result.stdout
        assert "| naive W2S |" in result.stdout and "| confidence W2S |" in result.stdout

        client = MlflowClient(uri, registry_uri=uri)
        version = client.get_model_version_by_alias(NAME, "challenger")
        assert str(version.version) == "1"
        for tag in ("mean_nts", "wrg", "id_accuracy", "test_splits_digest", "selection_splits", "val_mean_nts",
                    "validation_splits_digest"):
            assert tag in version.tags, tag
        assert version.tags["selection_splits"] == "val" and version.tags["figure_splits"] == "test"
        assert "Selected on val splits" in version.description

        # one parent run; one child per trial (2 baselines + 2 ANCHOR samples) plus the final evaluation
        exp = client.get_experiment_by_name("anchor-rm-helpful")
        parent = client.search_runs([exp.experiment_id], "tags.`anchor_rm.stage` = 'tune'")
        assert len(parent) == 1
        children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent[0].info.run_id}'")
        trials = [c for c in children if c.data.tags.get("anchor_rm.stage") == "trial"]
        assert len(trials) == 4 and all(c.info.status == "FINISHED" for c in trials)
        for trial in trials:
            assert trial.data.tags["anchor_rm.teacher_run"] and "train.method" in trial.data.params
            assert len(client.get_metric_history(trial.info.run_id, "val/mean_nts")) >= 1
            assert len(client.get_metric_history(trial.info.run_id, "train/loss")) >= 3
        final = [c for c in children if c.data.tags.get("anchor_rm.stage") == "final"]
        assert len(final) == 1 and final[0].info.run_id == version.run_id
        names = {a.path.split("/")[-1] for a in client.list_artifacts(version.run_id, "report")}
        assert {"report.json", "report.md", "report.png", "comparison.md", "nts_vs_lambda.png", "trials.json"} <= names

        # Smoke models learn from 48 pairs: the ID gate is the promotion test's business, not this one's.
        promoted = run_pipeline("promote.py", "--name", NAME, "--max-id-drop", "100", "--tracking-uri", uri,
                                cwd=tmp_path, timeout=300)
        assert promoted.returncode == 0, promoted.stdout + promoted.stderr
        assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"

        mlflow.set_tracking_uri(uri)
        mlflow.set_registry_uri(uri)  # an earlier test may have set another registry in this process
        model = mlflow.pyfunc.load_model(f"models:/{NAME}@champion")
        frame = pd.DataFrame({"prompt": ["How do I bake bread?"] * 2,
                              "response": ["Mix flour, water, yeast and salt, let it rise, then bake.", "No."]})
        scored = model.predict(frame)
        assert list(scored.columns) == ["reward", "truncated"] and len(scored) == 2
        assert scored["reward"].notna().all()

        # --resume of a finished experiment redoes nothing and registers nothing new
        again = run_pipeline("tune.py", *args, "--resume", cwd=tmp_path, timeout=900)
        assert again.returncode == 0, again.stderr[-4000:]
        assert len(client.search_model_versions(f"name = '{NAME}'")) == 1
        trials_after = client.search_runs([exp.experiment_id], "tags.`anchor_rm.stage` = 'trial'")
        assert len(trials_after) == 4
