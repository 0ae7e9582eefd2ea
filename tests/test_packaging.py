"""Packaged the way MLflow's tools expect: a registered version carries its code (models from code, anchor_rm as
code_paths) and requirements that rebuild a working environment with no anchor-rm installed; versions
registered before, as a pickled class, keep loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from helpers import free_port, sqlite_store, tiny_model_folder, wait_http

NAME = "anchor-rm-packaging"
PAIRS = [("How do I boil an egg?", "Put it in boiling water for 8 to 10 minutes."),
         ("How do I boil an egg?", "Eggs are not food."),
         ("Say something kind.", "You are doing well, keep going.")]


def _report():
    from anchor_rm.evaluation.report import SplitResult, build_report

    rows = [SplitResult("a", "id", "test", 20, 55.0, 60.0, None, 0.0),
            SplitResult("b", "ood", "test", 20, 50.0, 52.0, None, 0.0)]
    return build_report({"name": NAME, "student": "tiny", "teacher": "tiny-teacher", "method": "naive",
                         "hyperparameters": {}}, rows, selection_splits="val", figure_splits="test")


def _library_rewards(folder: Path) -> list[float]:
    from anchor_rm.model.reward_model import load_saved

    scored = load_saved(folder).scorer().score([p for p, _ in PAIRS], [r for _, r in PAIRS])
    return [float(x) for x in scored.rewards]


def _register(tmp_path: Path, tokenizer) -> tuple[str, Path]:
    """A tiny reward model registered as the pipelines register one, with the champion alias; (store URI,
    the model folder)."""
    import mlflow

    from anchor_rm.mlflow_edge import registry

    folder = tiny_model_folder(tmp_path / "student", tokenizer, 0, 64, "tiny", {"method": "naive"})
    with mlflow.start_run():
        version = registry.log_and_register(folder, _report(), NAME)
    mlflow.MlflowClient().set_registered_model_alias(NAME, "champion", version.version)
    return mlflow.get_tracking_uri(), folder


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_champions_own_requirements_rebuild_an_environment_where_mlflow_models_serve_scores(tmp_path,
                                                                                                minilm_tokenizer):
    """The user's path without this project: `pip install -r` the version's requirements into a fresh virtual
    environment (pip's configured indexes and wheel folders serve them: torch's build follows the index), then
    `mlflow models serve` from a folder outside the checkout; its rewards are the library's. And the Dockerfile
    `mlflow models build-docker` builds from holds the model's code."""
    import mlflow

    with sqlite_store(tmp_path, "packaging") as uri:
        uri, folder = _register(tmp_path, minilm_tokenizer)
        expected = _library_rewards(folder)
        requirements = Path(mlflow.pyfunc.get_model_dependencies(f"models:/{NAME}@champion"))
    listed = requirements.read_text().split()
    assert not [r for r in listed if r.lower().startswith(("anchor-rm", "anchor_rm"))], listed  # no package to find
    assert any(r.startswith("torch==") for r in listed) and any(r.startswith("mlflow==") for r in listed), listed

    env_dir = tmp_path / "fresh-env"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300)
    bin_dir = env_dir / "bin"
    outside = tmp_path / "elsewhere"  # no checkout on the path: not the working directory, not PYTHONPATH
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MLFLOW_REGISTRY_URI")}
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "MLFLOW_TRACKING_URI": uri,
                "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    # --no-cache-dir: nothing of the 1.5 GB goes into pip's cache as well (the suite's HOME is empty).
    install = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-compile", "--no-cache-dir",
                              "-r", str(requirements)], cwd=outside, env=env, capture_output=True, text=True,
                             timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    probe = subprocess.run([str(bin_dir / "python"), "-c", "import anchor_rm"], cwd=outside, env=env,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'anchor_rm'" in probe.stderr  # the model brings its own code

    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([str(bin_dir / "mlflow"), "models", "serve", "-m", f"models:/{NAME}@champion",
                               "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)],
                              cwd=outside, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/ping", timeout=300, proc=server)
        body = json.dumps({"dataframe_split": {"columns": ["prompt", "response"], "data": [list(p) for p in PAIRS]}})
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            predictions = json.loads(response.read())["predictions"]
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
        log.close()
    served = [row["reward"] for row in predictions]
    assert served == pytest.approx(expected, abs=1e-6), (served, expected)
    assert [row["truncated"] for row in predictions] == [False] * len(PAIRS)

    dockerfile = subprocess.run([str(bin_dir / "mlflow"), "models", "generate-dockerfile", "-m",
                                 f"models:/{NAME}@champion", "-d", str(tmp_path / "docker")], cwd=outside, env=env,
                                capture_output=True, text=True, timeout=300)
    assert dockerfile.returncode == 0, dockerfile.stderr[-3000:]
    model_dir = tmp_path / "docker" / "model_dir"
    assert (model_dir / "code" / "anchor_rm" / "model" / "scoring.py").is_file()
    assert (model_dir / "requirements.txt").is_file()
    assert not (model_dir / "code" / "anchor_rm" / "shipped_data").exists()  # code, not the datasets


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_version_registered_as_a_pickled_class_keeps_loading(tmp_path, minilm_tokenizer):
    """Versions logged before models from code hold a cloudpickled RewardModelPyfunc (anchor_rm.registry's or
    mlflow_edge.model_package's name for it): MLflow's loader and the service's loader both still read them."""
    import mlflow
    import pandas as pd

    from anchor_rm.evaluation.keys import REPORT_ARTIFACT, REWARD_MODEL_ARTIFACT
    from anchor_rm.evaluation.report_files import write_report
    from anchor_rm.mlflow_edge import model_package
    from anchor_rm.registry import RewardModelPyfunc as OldName

    with sqlite_store(tmp_path, "packaging-old") as uri:
        folder = tiny_model_folder(tmp_path / "student", minilm_tokenizer, 0, 64, "tiny", {"method": "naive"})
        write_report(_report(), tmp_path / "report")
        with mlflow.start_run():
            info = mlflow.pyfunc.log_model(name="model", python_model=OldName(), signature=model_package.SIGNATURE,
                                           artifacts={REWARD_MODEL_ARTIFACT: str(folder),
                                                      REPORT_ARTIFACT: str(tmp_path / "report")})
        version = mlflow.register_model(info.model_uri, NAME)
        loaded = mlflow.pyfunc.load_model(f"models:/{NAME}/{version.version}")
        frame = pd.DataFrame({"prompt": [p for p, _ in PAIRS], "response": [r for _, r in PAIRS]})
        assert loaded.predict(frame)["reward"].tolist() == pytest.approx(_library_rewards(folder), abs=1e-6)
        resolved = model_package.resolve_model_uri(f"models:/{NAME}/{version.version}", tmp_path / "download")
        assert (resolved.folder / "config.json").is_file() and model_package.find_report(resolved.folder)
        assert uri.startswith("sqlite:///")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bentoml_build_makes_a_bento_that_serves_the_champion(tmp_path, minilm_tokenizer):
    """`bentoml build` from the repository root (bentofile.yaml) makes a Bento with the service, the library and
    the tested package set; `bentoml serve <that bento>` from another folder scores the champion as the library."""
    from helpers import ROOT

    with sqlite_store(tmp_path, "packaging-bento") as uri:
        uri, folder = _register(tmp_path, minilm_tokenizer)
        expected = _library_rewards(folder)
    bentoml = Path(sys.executable).parent / "bentoml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANCHOR_RM_", "BENTOML_", "MLFLOW_"))}
    env.update({"BENTOML_HOME": str(tmp_path / "bentoml"), "BENTOML_DO_NOT_TRACK": "true", "MLFLOW_TRACKING_URI": uri,
                "ANCHOR_RM_MODEL_URI": f"models:/{NAME}@champion", "OMP_NUM_THREADS": "1",
                "ANCHOR_RM_DOWNLOAD_DIR": str(tmp_path / "downloads")})
    build = subprocess.run([str(bentoml), "build", str(ROOT), "--output", "tag"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    tag = build.stdout.strip().splitlines()[-1].removeprefix("__tag__:")
    assert tag.startswith("anchor_rm_reward:"), build.stdout[-500:]
    bento = next((tmp_path / "bentoml" / "bentos" / "anchor_rm_reward").glob("*/bento.yaml")).parent
    assert (bento / "src" / "service" / "service.py").is_file()
    assert (bento / "src" / "anchor_rm" / "model" / "scoring.py").is_file()
    requirements = (bento / "env" / "python" / "requirements.txt").read_text()
    assert "torch==2.13.0" in requirements and "mlflow==" in requirements  # constraints.txt: the tested set

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    port = free_port()
    log = (tmp_path / "bento-serve.log").open("w")
    server = subprocess.Popen([str(bentoml), "serve", tag, "--port", str(port)], cwd=outside, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=300, proc=server)
        body = json.dumps({"items": [{"prompt": p, "response": r} for p, r in PAIRS]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/score", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
        log.close()
    assert answer["model"]["name"] == NAME and answer["model"]["version"] == "1", answer
    assert answer["rewards"] == pytest.approx(expected, abs=1e-6), (answer["rewards"], expected)
