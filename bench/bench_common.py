"""Small helpers shared by the training and scoring benchmarks (not a library module)."""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def machine() -> str:
    import torch

    from anchor_rm.model.precision import describe_hardware

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} cores ({describe_hardware('cpu')}), {gpu}, Python {platform.python_version()}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")


def service_machine() -> str:
    import bentoml

    return f"{machine()}, bentoml {bentoml.__version__}"


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def source_splits(source: str, seed: int, max_pairs: dict[str, int]):
    """The source dataset's prompt-disjoint splits (no OOD targets), capped as the presets cap them."""
    from anchor_rm.data.splits import build_protocol_splits

    return build_protocol_splits(source, [], seed, max_pairs=max_pairs)


def median(values) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def positive_int(text: str) -> int:
    """argparse type: a clear message instead of a traceback for 0, negatives and non-numbers."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _busy_seconds() -> float:
    """CPU seconds all processes on the machine have spent busy since boot (/proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def process_tree(root: int) -> set[int]:
    """`root` and its live descendants (from /proc/<pid>/stat)."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent_of[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parent_of.items() if parent == pid and child not in tree]
        tree.update(children)
        frontier += children
    return tree


def tree_seconds_by_kind(root: int) -> dict[str, float]:
    """CPU seconds the live process `root` and its live descendants have spent (/proc/<pid>/stat), summed by
    kind: a Ray actor or worker by the name Ray gives its process (ray::TrainController ...), anything else by
    its executable's name."""
    out: dict[str, float] = {}
    for pid in process_tree(root):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        kind = command.split()[0].split(".")[0] if command.startswith("ray::") else stat[stat.find("(") + 1:stat.rfind(")")]
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _tree_seconds(root: int) -> float:
    """CPU seconds the live process `root` and its live descendants have spent (/proc/<pid>/stat)."""
    return sum(tree_seconds_by_kind(root).values())


class Disturbance:
    """How much CPU other processes took while a measurement ran, as a fraction of the machine's capacity
    over that time. The rule the benchmarks state before they run: a repeat with more than
    DISTURBED (10%) is disturbed; it is reported, marked, and left out of the medians.

        with Disturbance() as d:
            ...
        d.fraction, d.disturbed

    `others_than`: running processes (e.g. servers this benchmark started) whose trees count as its own.
    """

    DISTURBED = 0.10

    def __init__(self, others_than: Sequence[int] = ()):
        self._servers = list(others_than)

    def _own(self) -> float:
        return _own_seconds() + sum(_tree_seconds(pid) for pid in self._servers)

    def __enter__(self):
        self._busy, self._own_start, self._wall = _busy_seconds(), self._own(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self._wall
        others = (_busy_seconds() - self._busy) - (self._own() - self._own_start)
        self.fraction = max(0.0, others) / max(wall * (os.cpu_count() or 1), 1e-9)
        self.disturbed = self.fraction > self.DISTURBED
        return False


# ---------------------------------------------------------------------------------------------------
# A registered model and a `bentoml serve` process, for the service benchmarks (bench_service, load_service).

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_reward_model(model: str, max_length: int, seed: int):
    """`tiny` (a 2-layer, 32-wide BERT on MiniLM's vocabulary, random) or a pretrained model with a fresh head."""
    from anchor_rm.model.reward_model import load_pretrained

    if model != "tiny":
        return load_pretrained(model, max_length, seed=seed)
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from anchor_rm.model.encoding import RewardEncoder
    from anchor_rm.model.loading import load_tokenizer, resolve_model
    from anchor_rm.model.reward_model import RewardModel

    tokenizer = load_tokenizer(resolve_model("minilm-l6"))
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    return RewardModel(BertForSequenceClassification(config).eval(), tokenizer,
                       RewardEncoder(tokenizer, max_length, decoder=False), "tiny-bert")


def register_versions(workdir: Path, model: str, max_length: int, name: str, seeds: Sequence[int],
                      experiment: str) -> tuple[str, dict[str, Path]]:
    """One registered version per seed (its reward head's seed) in a SQLite store under workdir, with a
    placeholder report; champion -> the first. Returns (tracking URI, {version: model folder})."""
    from anchor_rm.evaluation.report import SplitResult, build_report
    from anchor_rm.mlflow_edge import registry, runs
    from anchor_rm.mlflow_edge.store import configure
    from anchor_rm.model.reward_model import save_reward_model

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    configure(uri, experiment)
    rows = [SplitResult("hh-helpful-base", "id", "test", 470, 60.0, 60.0, None, 0.0),
            SplitResult("pandalm", "ood", "test", 300, 50.0, 50.0, None, 0.0)]
    report = build_report({"name": name, "student": model, "teacher": "none", "method": "benchmark",
                           "hyperparameters": {}}, rows, selection_splits="val", figure_splits="test",
                          data_digests={"hh-helpful-base/id_test": "0" * 64, "pandalm/test": "1" * 64})
    folders = {}
    for seed in seeds:
        folder = save_reward_model(bench_reward_model(model, max_length, seed), workdir / f"model{seed}")
        with runs.start_run():
            folders[registry.log_and_register(folder, report, name).version] = folder
    registry.set_alias(name, "champion", next(iter(folders)))
    return uri, folders


def start_service(workdir: Path, env: dict[str, str], log_name: str = "serve.log",
                  timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """`bentoml serve` on a free port of 127.0.0.1 with the service's settings in `env` (on top of this
    environment less any ANCHOR_RM_, BENTOML_ or MLFLOW_ variable); returns once /readyz answers."""
    import urllib.request

    from service.config import serve_command

    stop_services_on_sigterm()
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("ANCHOR_RM_", "BENTOML_", "MLFLOW_"))}
    full_env.update({"BENTOML_HOME": str(workdir / "bentoml"), "BENTOML_DO_NOT_TRACK": "true", "HF_HUB_OFFLINE": "1",
                     "TOKENIZERS_PARALLELISM": "false", **env})
    with open(workdir / log_name, "w") as log:
        proc = subprocess.Popen(serve_command(port, "127.0.0.1"), cwd=ROOT, env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"bentoml serve exited with {proc.returncode}; see {workdir / log_name}")
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        return proc, url
            except OSError:
                time.sleep(0.5)
    except BaseException:  # stopped while it starts (SIGTERM, Ctrl-C): the caller never gets it to stop
        stop_service(proc)
        raise
    stop_service(proc)
    raise TimeoutError(f"bentoml serve did not become ready within {timeout:.0f} s; see {workdir / log_name}")


def stop_services_on_sigterm() -> None:
    """SIGTERM (`timeout`, `kill`) ends this process through SystemExit, so that the `finally` blocks that stop
    its servers run: the servers live in their own sessions and would otherwise go on, each taking CPU from
    whatever is measured next."""
    import signal

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def stop_service(proc) -> None:
    import signal

    if proc.poll() is not None:
        return
    # bentoml serve's worker runs in a session of its own: an arbiter stopped before it set up its own
    # shutdown would leave it running, so whatever of the tree outlives the arbiter is killed too
    tree = [pid for pid in process_tree(proc.pid) if pid != proc.pid]
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    for pid in tree:
        try:
            if b"bentoml" in Path(f"/proc/{pid}/cmdline").read_bytes():  # still one of them, not a reused pid
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def load_pairs(limit: int = 400) -> list[tuple[str, str]]:
    """(prompt, response) pairs of HH helpful-base, both responses of each pair, none empty."""
    from anchor_rm.data.catalog import load_dataset_pairs
    from anchor_rm.data.splits import clean_pairs

    pairs = []
    for pair in clean_pairs(load_dataset_pairs("hh-helpful-base"))[0]:  # no empty responses: those get a 400
        pairs += [(pair.prompt, pair.chosen), (pair.prompt, pair.rejected)]
        if len(pairs) >= limit:
            break
    return pairs
