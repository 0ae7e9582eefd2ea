"""The served service, shared by tests/test_service_http.py and tests/test_fuzz.py (a pytest plugin named in
conftest.py): a temporary SQLite registry with two versions of a tiny model, a real `bentoml serve` process
on a free local port serving the champion, and an authenticated HTTP client. Module-scoped: each test module
that asks for them gets its own store and server."""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from anchor_rm.evaluation.report import SplitResult, build_report
from helpers import ROOT, free_port, register_version, sqlite_store, tiny_model_folder, wait_http
from service.config import serve_command

NAME = "anchor-rm-harmless"  # what the service serves and promote.py names by default
KEY = "test-key-7f3a9c"
SECRET_TEXT = "ZEBRA-QUOKKA-4471"  # sent in bodies; must never reach the server log
MAX_LENGTH = 48
LIMITS = {"ANCHOR_RM_MAX_ITEMS": "8", "ANCHOR_RM_MAX_CANDIDATES": "4", "ANCHOR_RM_MAX_TEXT_BYTES": "4000",
          "ANCHOR_RM_MAX_BODY_BYTES": "200000"}


def served_report(mean_ood: float):
    rows = [SplitResult("hh-helpful-base", "id", "test", 470, 60.0, 61.0, None, 0.0),
            SplitResult("pandalm", "ood", "test", 300, 50.0, mean_ood, None, 0.0)]
    model = {"name": NAME, "student": "tiny-bert", "teacher": "tiny-teacher", "method": "anchor", "hyperparameters": {}}
    return build_report(model, rows, selection_splits="val", figure_splits="test",
                        data_digests={"hh-helpful-base/id_test": "a" * 64, "pandalm/test": "b" * 64})


def fit_pairs(n: int, offset: int = 0):
    """Short HH-like pairs the served model's OOD flag is fitted on (and thresholded on, with an offset)."""
    from anchor_rm.data.records import PreferencePair

    topics = ["eggs", "tea", "bread", "rain", "a bicycle", "the moon", "a cat", "soup", "a letter", "music"]
    return [PreferencePair(f"Human: how do I look after {topics[(i + offset) % 10]}?\n\nAssistant:",
                           f"Gently, and check on {topics[(i + 3) % 10]} every day.",
                           f"I do not know about {topics[(i + offset + 5) % 10]}.", "fit") for i in range(n)]


@pytest.fixture(scope="module")
def store(tmp_path_factory, minilm_tokenizer):
    """Two registered versions of tiny random BERTs (different seeds), champion on version 1. Version 1 carries
    an OOD flag (fitted as final_report fits it, on tiny fit pairs); version 2 none (a version registered
    before the flag existed)."""
    from anchor_rm.evaluation.scores import fit_ood_flag
    from anchor_rm.mlflow_edge.registry import set_alias
    from anchor_rm.model.reward_model import load_saved

    workdir = tmp_path_factory.mktemp("service")
    with sqlite_store(workdir, "service-http-tests") as uri:
        folders = {}
        for seed in (0, 1):
            folder = tiny_model_folder(workdir / f"model{seed}", minilm_tokenizer, seed, MAX_LENGTH)
            if seed == 0:
                fitted = load_saved(folder)
                fit_ood_flag(fitted, fit_pairs(60), fit_pairs(30, offset=1), fit_split="student_train",
                             threshold_split="fit/val")
                fitted.density.save(folder)
            folders[register_version(folder, served_report(54.0 + seed), NAME)] = folder
        set_alias(NAME, "champion", "1")
        scorers = {v: load_saved(f).scorer() for v, f in folders.items()}
        yield {"uri": uri, "workdir": workdir, "scorers": scorers}


@pytest.fixture(scope="module")
def server(store):
    """`bentoml serve` without --host: the service's own default must bind 127.0.0.1."""
    workdir = store["workdir"]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANCHOR_RM_", "BENTOML_", "MLFLOW_"))}
    env.update({"MLFLOW_TRACKING_URI": store["uri"], "BENTOML_HOME": str(workdir / "bentoml"), "BENTOML_DO_NOT_TRACK": "true",
                "ANCHOR_RM_API_KEY": KEY, "ANCHOR_RM_POLL_SECONDS": "2", "ANCHOR_RM_DOWNLOAD_DIR": str(workdir / "downloads"),
                "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **LIMITS})
    log_path = workdir / "bentoml-serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(serve_command(port),
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=180, proc=proc)
        yield {"url": f"http://127.0.0.1:{port}", "port": port, "log": log_path, "proc": proc}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        log.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        yield client


PROMPTS = ["How do I boil an egg?", "Human: tell me a joke\n\nAssistant:", "word " * 80, f"What is {SECRET_TEXT}?"]
RESPONSES = ["Put it in boiling water for eight minutes.", "Why did the chicken cross the road?", "Short.",
             "I do not know that word."]
