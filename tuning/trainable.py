"""One Tune trial = one Ray Train `TorchTrainer` (N workers, DDP: gloo on CPU, nccl on GPU) running the
library's training loop. The Ray 2.60 pattern: a Tune function builds and fits the TorchTrainer, and
`TuneReportCallback` carries each epoch's validation metrics from the workers to Tune (and ASHA).

Each trial is an MLflow child run of the tune experiment's parent run. Rank 0 logs per-step losses and
per-epoch validation metrics to it; the run id lives in the trial's config, so a worker restarted from a
checkpoint keeps writing to the same run instead of opening a duplicate.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from anchor_rm.data.splits import ProtocolSplits
from anchor_rm.pipeline.config import ProtocolConfig
from tuning.space import DRIFT_RESULT, METRIC, trial_method_config
from tuning.storage import experiment_filesystem

TRAINING_STATE = "training_state.pt"
# In each checkpoint: the checkpointed model's scores on every validation set, measured after that epoch
# (scores.scores_to_dict). The final evaluation takes them instead of scoring the model on them again.
VALIDATION_SCORES = "validation_scores.json"
# The anchor loss's scale is the mean over this many steps: at the trial's start and at the end of each epoch.
ANCHOR_SCALE_STEPS = 10
log = logging.getLogger("anchor_rm")

# A function every worker calls after each training step, named by STEP_HOOK_ENV as
# "<python file>:<function>[:<argument>]" and called as function(step, rank, argument). Unset (always, in
# production), nothing is loaded. The fault tests install one (tests/fault_hooks.py) to kill a worker at a
# chosen step and watch Ray Train restore the trial from its checkpoint.
STEP_HOOK_ENV = "ANCHOR_RM_TRAIN_STEP_HOOK"


def load_step_hook(spec: str | None):
    """The hook STEP_HOOK_ENV names, as a function of (step, rank); None when unset."""
    if not spec:
        return None
    import importlib.util

    path, function, *argument = spec.split(":", 2)
    module_spec = importlib.util.spec_from_file_location(f"anchor_rm_step_hook_{Path(path).stem}", path)
    if module_spec is None or not Path(path).is_file():
        raise ValueError(f"{STEP_HOOK_ENV}: no Python file {path!r} (expected <file.py>:<function>[:<argument>])")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    hook = getattr(module, function, None)
    if hook is None:
        raise ValueError(f"{STEP_HOOK_ENV}: {path} has no function {function!r}")
    return lambda step, rank: hook(step, rank, argument[0] if argument else None)


@dataclass
class SharedPayload:
    """Everything trials share, computed once by the driver and handed out through the object store."""

    cfg: ProtocolConfig
    splits: ProtocolSplits
    soft_labels: list[float]
    teacher_val: dict  # dataset -> SplitScore dict, the teacher's validation accuracies (for NTS)
    headline_targets: list  # the OOD targets val/mean_nts averages (SharedStages.headline_targets)
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    storage_path: str  # the experiment's folder: Tune state and Train checkpoints live under it
    num_workers: int = 1
    cpus_per_worker: float = 1.0  # logical CPUs Ray reserves for each worker
    threads_per_worker: int = 1  # torch threads in each worker
    use_gpu: bool = False
    # What the trials' TrainConfig.precision starts as: the driver's resolved value where the trials run on CPUs
    # like the driver's, the requested one (auto, fp32, bf16) where they run on GPUs; each worker resolves it for
    # its own device (train_loop_per_worker).
    trial_precision: str = "auto"
    max_failures: int = 2
    tags: dict = field(default_factory=dict)  # links to the data/teacher/ceiling stage runs
    reference_states: object = None  # ObjectRef of the frozen reference's states on student-train (all layer choices),
    # in RAM or on disk (reference_cache.DiskReferenceStates: a folder under storage_path)
    reference_live: bool = False  # no cache: each worker runs the frozen reference beside the student


def _train_config(payload: SharedPayload, config: dict):
    from anchor_rm.method.training import TrainConfig

    return TrainConfig(**{**payload.cfg.student_train.to_dict(), "precision": payload.trial_precision,
                          **trial_method_config(config)})


def read_training_state(folder: Path) -> dict:
    """A checkpoint's training state (epoch, optimizer and scheduler states), its tensors on the CPU: the worker that
    wrote it may have held them on its own GPU, which a restarted worker may not be given; the optimizer moves its
    state to its parameters' device when it loads it."""
    return torch.load(Path(folder) / TRAINING_STATE, weights_only=False, map_location="cpu")


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's per-worker function: build the student, resume from the latest checkpoint if any, train
    (student.train_student: one student run, as everywhere), and after each epoch measure on the validation
    splits (rank 0), checkpoint and report.

    The precision is resolved here for this worker's device (payload.trial_precision: what --precision asked for
    where the trials run on GPUs, whose bf16 the driver's CPU says nothing about). With --strategy fsdp2 the
    student is loaded sharded (sharded.load_pretrained_sharded; at one worker too): every worker runs the
    validation passes (each forward pass gathers the layers from all of them; rank 0 logs), and every worker
    writes its shard of the weights and optimizer state into the epoch's checkpoint, which Ray Train gathers into
    one folder (sharded.save_sharded); a restarted or resumed trial reads it at any number of workers. A LoRA
    student's checkpoint holds its adapters and head alone. final.checkpoint_folder turns the selected one into an
    ordinary Hugging Face folder."""
    import ray.train
    import ray.train.torch

    from anchor_rm.method.drift import drift_probe
    from anchor_rm.method.stages import load_student
    from anchor_rm.mlflow_edge.writer import BufferedRunWriter
    from anchor_rm.model.lora import ADAPTER_FOLDER
    from anchor_rm.model.precision import resolve_precision
    from anchor_rm.model.reward_model import load_saved
    from anchor_rm.model.sharded import SHARDED_FOLDER

    payload: SharedPayload = config["payload"]
    torch.set_num_threads(payload.threads_per_worker)
    cfg = payload.cfg
    train_cfg = _train_config(payload, config)
    device = ray.train.torch.get_device()
    train_cfg.precision = resolve_precision(train_cfg.precision, device.type)
    rank = ray.train.get_context().get_world_rank()
    sharded = train_cfg.strategy == "fsdp2"

    start_epoch, optimizer_state, undelivered, state = 0, None, [], {}
    checkpoint = ray.train.get_checkpoint()
    # Rank 0 measures the drift probe. Not under FSDP2: a pass over the sharded student before it trains left its
    # optimizer state unsavable (torch.distributed.checkpoint found parameters it did not know; not solved), so
    # sharded trials report no drift.
    measures = rank == 0 and not sharded

    def probe(model):  # the drift probe's pretrained states, from `model` before it trains (LoRA: adapters off)
        return drift_probe(model, payload.splits.student_train, batch_size=cfg.eval_batch_size,
                           precision=train_cfg.precision) if measures else None

    with contextlib.ExitStack() as opened:
        if checkpoint is None:
            rm = load_student(cfg.student, train_cfg, device)
            pretrained = probe(rm)
        else:  # a restarted worker or a resumed experiment: continue after the last finished epoch
            # Open until training ends: a sharded checkpoint is read once the student is sharded.
            folder = Path(opened.enter_context(checkpoint.as_directory()))
            state = read_training_state(folder)
            undelivered = BufferedRunWriter.read_pending(folder)
            start_epoch, optimizer_state = state["epoch"] + 1, state["optimizer_state"]
            if (folder / SHARDED_FOLDER).is_dir():  # FSDP2: the pretrained student, then the shards read into it
                rm = load_student(cfg.student, train_cfg, device)
                optimizer_state = {**optimizer_state, "sharded": folder}
                pretrained = probe(rm)
            elif train_cfg.lora_rank:  # the pretrained base with the checkpoint's adapters
                rm = load_student(cfg.student, train_cfg, device, adapters=folder / ADAPTER_FOLDER)
                pretrained = probe(rm)
            else:  # the pretrained student for the probe's states, freed before the checkpoint's is loaded
                pretrained = probe(load_student(cfg.student, train_cfg, device)) if measures else None
                rm = load_saved(folder, device=device)
        _train_trial(payload, config, train_cfg, rm, device, rank, sharded, start_epoch, optimizer_state, undelivered,
                     pretrained, state.get("anchor_loss_start"))


def _train_trial(payload: SharedPayload, config: dict, train_cfg, rm, device, rank: int, sharded: bool,
                 start_epoch: int, optimizer_state: dict | None, undelivered: list, probe=None,
                 anchor_loss_start: float | None = None) -> None:
    """One worker's training of the trial, from `start_epoch` (train_loop_per_worker has loaded the student and
    measured the drift probe's pretrained states, `probe`). Each epoch reports, beside the validation metrics, the
    last-layer drift on the probe and the anchor loss's scale: the mean of the trial's first ANCHOR_SCALE_STEPS
    steps (kept in the checkpoint, so that a resumed trial reports its first epoch's) and of the epoch's last."""
    import resource

    import ray.train

    from anchor_rm.evaluation import keys
    from anchor_rm.evaluation.scores import scores_from_dict, scores_to_dict
    from anchor_rm.method.stages import frozen_reference
    from anchor_rm.method.student import NoSink, Validation, train_student
    from anchor_rm.mlflow_edge import runs
    from anchor_rm.mlflow_edge.writer import BufferedRunWriter
    from anchor_rm.model.reward_model import save_reward_model
    from anchor_rm.model.sharded import load_pretrained_sharded, save_sharded

    cfg, run_id = payload.cfg, config["mlflow_run_id"]
    rm.model.train()
    # The frozen reference's states: computed once by the driver, shared by every trial via the object store; or
    # (live) the frozen model itself, loaded by each worker (sharded with the student under FSDP2).
    reference = None
    if train_cfg.uses_anchor and not train_cfg.lora_rank:  # LoRA: the student with its adapters off
        if not payload.reference_live:
            reference = ray.get(payload.reference_states)
        elif sharded:
            reference = load_pretrained_sharded(cfg.student, device, precision=train_cfg.precision).eval()
        else:
            reference = frozen_reference(cfg.student, device)
    writer = BufferedRunWriter(payload.tracking_uri, run_id, active=True) if rank == 0 else None
    if writer is not None:
        writer.restore(undelivered)  # what the checkpoint's writer had not sent (the server was unreachable)
        runs.set_run_tag(payload.tracking_uri, run_id, f"{keys.RAY_NODE_TAG_PREFIX}{start_epoch}",
                         ray.get_runtime_context().get_node_id())
        runs.set_run_tag(payload.tracking_uri, run_id, keys.PROCESS_GROUP_TAG,  # gloo on CPU, nccl on GPU
                         torch.distributed.get_backend() if torch.distributed.is_initialized() else "none")
        runs.set_run_tag(payload.tracking_uri, run_id, keys.PRECISION_TAG, train_cfg.precision)
    if start_epoch and writer is not None:
        runs.set_run_tag(payload.tracking_uri, run_id, keys.RESUMED_FROM_EPOCH_TAG, str(start_epoch - 1))
    validation = None
    if rank == 0 or sharded:  # a sharded student's forward pass needs every worker
        validation = Validation(payload.splits, scores_from_dict(payload.teacher_val), payload.headline_targets,
                                cfg.eval_batch_size, train_cfg.precision, drift_probe=probe)

    step_hook = load_step_hook(os.environ.get(STEP_HOOK_ENV))
    first_steps, epoch_steps = [], []  # (anchor loss, W2S loss) of the run's first steps and of this epoch's

    def after_step(entry) -> None:
        if len(first_steps) < ANCHOR_SCALE_STEPS:
            first_steps.append((entry.anchor_loss, entry.w2s_loss))
        epoch_steps.append((entry.anchor_loss, entry.w2s_loss))
        if step_hook is not None:
            step_hook(entry.step, rank)

    def after_epoch(epoch: int, metrics: dict, opt_state: dict, scores: dict | None) -> None:
        nonlocal anchor_loss_start
        if anchor_loss_start is None and first_steps:
            anchor_loss_start = float(np.mean([a for a, _ in first_steps]))
        last = epoch_steps[-ANCHOR_SCALE_STEPS:]
        scale = {"anchor_loss_start": anchor_loss_start,
                 "anchor_loss_end": float(np.mean([a for a, _ in last])) if last else None,
                 "w2s_loss_end": float(np.mean([w for _, w in last])) if last else None}
        epoch_steps.clear()
        # This worker's peak resident memory so far, evaluation included (Linux: ru_maxrss in KiB).
        peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        with tempfile.TemporaryDirectory() as tmp:
            peak = {"worker/peak_rss_mb": peak_rss_mb}
            if device.type == "cuda":  # the most GPU memory this worker's tensors held so far
                peak["worker/peak_vram_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
            if sharded:  # every worker its shard; Ray Train puts the workers' folders together
                save_sharded(tmp, rm.model, opt_state["sharded_optimizer"])
                opt_state = {k: v for k, v in opt_state.items() if k != "sharded_optimizer"}
            if writer is not None:
                writer.add({**peak, "worker/tracking_blocked_s": writer.blocked_s}, epoch)
                save_reward_model(rm, tmp, {"method": train_cfg.method, "teacher": cfg.teacher},
                                  adapters_only=True)  # a LoRA student: adapters and head, merged once when selected
                torch.save({"epoch": epoch, "optimizer_state": opt_state, "anchor_loss_start": anchor_loss_start},
                           Path(tmp) / TRAINING_STATE)
                if scores is not None:
                    (Path(tmp) / VALIDATION_SCORES).write_text(json.dumps(scores_to_dict(scores)))
                writer.checkpoint(tmp)  # one attempt to send; what the server did not take travels in the checkpoint
            tune_metrics = {METRIC: metrics.get("val/mean_nts", 0.0), "val_wrg": metrics.get("val/wrg", 0.0),
                            "val_id_acc": metrics.get(f"val/acc/{keys.metric_name(payload.splits.source)}", 0.0),
                            "epoch": epoch, **{k.replace("/", "_"): v for k, v in peak.items()},
                            **{k: v for k, v in scale.items() if v is not None}}
            if keys.DRIFT_METRIC in metrics:
                tune_metrics[DRIFT_RESULT] = metrics[keys.DRIFT_METRIC]
            keep = rank == 0 or sharded
            ray.train.report(tune_metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp) if keep else None)

    train_student(rm, payload.splits.student_train, payload.soft_labels, train_cfg, writer or NoSink(),
                  validation=validation, reference=reference, after_step=after_step, after_epoch=after_epoch,
                  start_epoch=start_epoch, optimizer_state=optimizer_state)
    if writer is not None:
        writer.deliver()


def train_run(config: dict, payload: SharedPayload, run_id: str, name: str, callbacks: list | None = None):
    """The Ray Train run of one trial: a TorchTrainer whose workers run `train_loop_per_worker` with the
    trial's `config`, writing to MLflow run `run_id`. Its checkpoints live under the experiment's storage
    as `name`: fitting a run of the same name again continues from its last checkpoint."""
    import ray.train
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={**config, "payload": payload, "mlflow_run_id": run_id},
        scaling_config=ray.train.ScalingConfig(
            num_workers=payload.num_workers, use_gpu=payload.use_gpu,
            resources_per_worker={"CPU": payload.cpus_per_worker, **({"GPU": 1} if payload.use_gpu else {})},
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=str(Path(payload.storage_path) / "train"),
            # Train's controller rewrites checkpoint_manager_snapshot.json after every epoch, which --resume
            # reads back: written whole or not at all, as Tune's files are (tuning/storage.py)
            storage_filesystem=experiment_filesystem(),
            failure_config=ray.train.FailureConfig(max_failures=payload.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
            callbacks=callbacks or [],
        ),
    )


def trial_driver(config: dict, payload: SharedPayload) -> None:
    """The Tune function of one trial: open (or find again) its MLflow child run, then fit the trial's Train
    run (`train_run`), which reports each epoch to Tune."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from tuning.callbacks import child_run_for_trial

    context = ray.tune.get_context()
    trial_id, trial_name = context.get_trial_id(), context.get_trial_name()
    run_id = child_run_for_trial(payload, trial_id, trial_name, _train_config(payload, config))
    # Named after the trial: a resumed Tune experiment restarts this Train run from its checkpoint.
    train_run(config, payload, run_id, f"train-{trial_id}", callbacks=[TuneReportCallback()]).fit()


# The Tune function only builds and watches the TorchTrainer, on the head node: there Ray Train keeps its own
# state actor, and it pins each trial's Train controller to the node of the function that calls fit. A worker
# node that dies then takes only Train workers with it, which Ray Train restarts from the trial's last
# checkpoint on a live node; a trial function on that node would die too, and Tune's retry of the whole trial
# once waited forever on a cluster still losing the node (a CI run of tests/test_cluster.py; not explained).
# It holds no CPU, so a head node started with none (KubeRay's advice) runs it; Ray needs a non-zero request,
# hence a sliver of the head node's own marker resource.
DRIVER_RESOURCES = {"CPU": 0, "node:__internal_head__": 0.001}


def worker_resources(node_cpus: list[float], concurrency: int, num_workers: int,
                     node_gpus: list[float] | None = None) -> tuple[float, int]:
    """(logical CPUs per worker, torch threads per worker) so that `concurrency` trials of `num_workers` workers
    each fit the cluster's nodes (`node_cpus`: each node's CPUs). A worker runs on one node, so it never asks
    more than a node has (a request sized on the whole cluster would wait forever on a cluster of small
    nodes). The trials' drivers hold no CPU (DRIVER_RESOURCES). With `node_gpus` (each node's GPUs: the trials
    run on GPUs, one per worker), only the nodes with GPUs count, each holding at most as many workers as it has
    GPUs: a CPU-only head's CPUs must not make the request bigger than a GPU node can give its GPUs' workers."""
    needed = concurrency * num_workers
    if node_gpus is None:
        nodes = [(cpus, needed) for cpus in node_cpus if cpus > 0]
    else:
        nodes = [(cpus, int(gpus + 1e-9)) for cpus, gpus in zip(node_cpus, node_gpus) if cpus > 0 and gpus >= 1]
        if sum(slots for _, slots in nodes) < needed:
            raise ValueError(f"nodes with {node_gpus} GPUs cannot hold {concurrency} concurrent trials of {num_workers} "
                             f"workers (one GPU each): lower --concurrency or --workers-per-trial")

    def fits(per_worker: float) -> bool:
        return sum(min(int(cpus / per_worker + 1e-9), slots) for cpus, slots in nodes) >= needed

    # Rounded down to hundredths: 8 CPUs for 3 workers is 2.66 each, and three such ask 7.98, not 8.01.
    candidates = sorted({math.floor(cpus / k * 100) / 100 for cpus, _ in nodes for k in range(1, needed + 1)},
                        reverse=True)
    logical = next((c for c in candidates if c > 0 and fits(c)), 0.0)
    if logical <= 0:
        raise ValueError(f"nodes with {node_cpus} CPUs cannot hold {concurrency} concurrent trials of "
                         f"{num_workers} workers")
    return logical, max(1, int(logical + 1e-9))


def node_resources() -> tuple[list[float], list[float]]:
    """The CPUs and the GPUs of each live node of the connected Ray cluster."""
    import ray

    alive = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    return [r.get("CPU", 0.0) for r in alive], [r.get("GPU", 0.0) for r in alive]


def make_payload(cfg: ProtocolConfig, shared, *, tracking_uri: str, experiment_id: str, parent_run_id: str,
                 storage_path: str, workers_per_trial: int, concurrency: int, use_gpu: str,
                 max_failures: int = 2, reference_cache: str = "auto",
                 reference_cache_budget: int | None = None, precision: str = "auto") -> SharedPayload:
    """What every trial shares (experiment.SharedStages -> SharedPayload), sized to the Ray cluster, with the
    frozen reference's states for every layer choice the search may pick in the object store, computed on the
    driver's device (its GPU where it has one; its memory handed back before the trials start).
    `use_gpu`: yes, no, or auto (when the cluster has a GPU). `precision`: what --precision asked for."""
    import ray

    from anchor_rm.method.reference_cache import ReferenceStates
    from anchor_rm.method.stages import reference_states
    from anchor_rm.model.reward_model import load_pretrained
    from tuning.space import LAYER_CHOICES

    gpus = ray.cluster_resources().get("GPU", 0)
    on_gpus = use_gpu == "yes" or (use_gpu == "auto" and gpus > 0)
    cpus, node_gpus = node_resources()
    cpus_per_worker, threads_per_worker = worker_resources(cpus, concurrency, workers_per_trial,
                                                           node_gpus if on_gpus else None)
    payload = SharedPayload(
        cfg=cfg, splits=shared.splits, soft_labels=shared.soft_labels(cfg.student_train.teacher_labels),
        teacher_val=shared.teacher.outputs["scores"]["val"], headline_targets=shared.headline_targets,
        tracking_uri=tracking_uri, experiment_id=experiment_id, parent_run_id=parent_run_id,
        storage_path=storage_path, num_workers=workers_per_trial, cpus_per_worker=cpus_per_worker,
        threads_per_worker=threads_per_worker, use_gpu=on_gpus,
        trial_precision=precision if on_gpus else cfg.precision, max_failures=max_failures,
        tags=shared.tags(),
    )
    started = time.perf_counter()
    train_cfg = cfg.student_train
    if train_cfg.lora_rank:
        log.info("LoRA students: ANCHOR's reference is each student with its adapters off (no states cached)")
        return payload
    rm = load_pretrained(cfg.student, train_cfg.max_length, train_cfg.seed, meta=True)  # tokenizer and shape
    states = reference_states(cfg.student, rm, shared.splits.student_train, LAYER_CHOICES, precision=train_cfg.precision,
                              batch_size=cfg.eval_batch_size, cache=reference_cache, budget_bytes=reference_cache_budget,
                              folder=Path(storage_path) / "reference_cache")
    if isinstance(states, ReferenceStates):
        log.info("reference states for layers %s (%s): %.0f MB in %.0f s", states.layers, states.kind,
                 states.nbytes() / 1e6, time.perf_counter() - started)
        payload.reference_states = ray.put(states)
    else:  # live: every trial's workers load the frozen reference themselves; the driver loads nothing for it
        payload.reference_live = True
    return payload
