"""The frozen reference's hidden states, computed once per dataset instead of once per step.

The reference model is frozen and the training inputs are fixed, so its hidden states at the anchored
layers are the same every epoch of every trial. ANCHOR only compares states on anchored positions (response tokens and
the head's read position, encoding.py), so only those are kept: about 1/7 of full fp32 states on HH (27% of tokens are responses), in half precision when
training runs under bf16 autocast (another half). One pass over the training pairs replaces a reference
forward pass in every training step.

Precision: the cache is computed in the training run's precision (anchor_rm/model/precision.py). Under bf16
autocast the student's own states carry bf16 rounding (about 4e-3 relative), so fp16 storage of the
reference (about 5e-4) adds nothing that matters. In fp32 the states are kept in fp32, so that an fp32 run's
anchor term is the uncached one (tests/test_training.py), not one computed against states rounded to fp16.

Where the states live (`choose_reference_cache`): in RAM (`ReferenceStates`, shared with Ray trials through
the object store) while they fit a memory budget; above it on disk (`DiskReferenceStates`: one
memory-mapped file per layer, written once, read by every trial and worker); and when the disk cannot hold
them either, nowhere: training runs the frozen reference live, one extra forward pass per step. The size
is known before anything is computed (`estimate_reference_nbytes`): anchored positions x hidden size x
bytes per value x layers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from anchor_rm.model.encoding import collate
from anchor_rm.model.precision import autocast, uses_bf16
from anchor_rm.model.scoring import EncodedPairs, capture_hidden_states, length_sorted_batches, reward_forward


def encoded_digest(encoded: EncodedPairs) -> str:
    """Identifies the exact token sequences a cache was computed on."""
    h = hashlib.sha256()
    for seq in encoded.chosen + encoded.rejected:
        h.update(np.asarray(seq.input_ids, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:32]


@dataclass
class ReferenceStates:
    """Response-token hidden states of the frozen reference, per sequence and anchored layer.

    Sequences are ordered as EncodedPairs.chosen + EncodedPairs.rejected; states[layer][k] is a
    [anchored positions, hidden] tensor, fp16 for a bf16 run and fp32 otherwise.
    """

    layers: list[int]
    states: dict[int, list[torch.Tensor]]
    digest: str
    num_pairs: int

    kind = "ram"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for per_layer in self.states.values() for t in per_layer)

    def row(self, layer: int, seq: int) -> torch.Tensor:
        """Sequence `seq`'s states at `layer`: [anchored positions, hidden]."""
        return self.states[layer][seq]

    def batch(self, pair_indices: list[int], layers: list[int], anchor_mask: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """States laid out like a training batch (chosen rows, then rejected rows), zero off the response.

        The anchor term multiplies every position by the response mask, so the zeros never count.
        """
        missing = [layer for layer in layers if layer not in self.layers]
        if missing:
            raise ValueError(f"reference cache holds layers {self.layers}, not {missing}")
        rows = list(pair_indices) + [self.num_pairs + i for i in pair_indices]
        out = []
        for layer in layers:
            states = [self.row(layer, seq) for seq in rows]
            full = torch.zeros((len(rows), anchor_mask.shape[1], states[0].shape[-1]), dtype=dtype)
            for r, seq_states in enumerate(states):
                positions = anchor_mask[r].nonzero(as_tuple=True)[0]
                full[r, positions] = seq_states.to(dtype)
            out.append(full.to(anchor_mask.device))
        return out


INDEX_FILE = "index.json"


@dataclass
class DiskReferenceStates(ReferenceStates):
    """The same states in `folder`: layer_<L>.bin holds every sequence's anchored rows back to back
    ([total positions, hidden], fp16 or fp32), index.json the offsets. Opened read-only and memory-mapped on
    first use in each process; pickles as its folder and offsets, so a Ray trial receives a few kB."""

    folder: str = ""
    offsets: list[int] = field(default_factory=list)  # sequence k is rows offsets[k]:offsets[k + 1]
    hidden: int = 0
    dtype: str = "float32"
    kind = "disk"

    def __post_init__(self):
        self._maps: dict[int, np.memmap] = {}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state

    def nbytes(self) -> int:
        return self.offsets[-1] * self.hidden * np.dtype(self.dtype).itemsize * len(self.layers)

    def row(self, layer: int, seq: int) -> torch.Tensor:
        if layer not in self._maps:
            self._maps[layer] = np.memmap(Path(self.folder) / f"layer_{layer}.bin", dtype=self.dtype, mode="r",
                                          shape=(self.offsets[-1], self.hidden))
        return torch.from_numpy(np.array(self._maps[layer][self.offsets[seq]:self.offsets[seq + 1]]))


def open_reference_states(folder: str | Path) -> DiskReferenceStates:
    path = Path(folder) / INDEX_FILE
    try:
        index = json.loads(path.read_text())
        return DiskReferenceStates(layers=index["layers"], states={}, digest=index["digest"], num_pairs=index["num_pairs"],
                                   folder=str(folder), offsets=index["offsets"], hidden=index["hidden"],
                                   dtype=index["dtype"])
    except (ValueError, KeyError, TypeError) as exc:  # ValueError includes a JSON syntax error
        raise ValueError(f"{path}: not a reference cache index ({type(exc).__name__}: {exc})") from exc


def anchored_positions(encoded: EncodedPairs) -> list[int]:
    """Anchored positions per sequence (chosen, then rejected): what the cache keeps of each."""
    return [int(sum(seq.anchor_mask)) for seq in encoded.chosen + encoded.rejected]


def estimate_reference_nbytes(encoded: EncodedPairs, num_layers: int, hidden: int, bytes_per_value: int) -> int:
    """The cache's size, known before it is computed."""
    return sum(anchored_positions(encoded)) * hidden * bytes_per_value * num_layers


CACHE_CHOICES = ("auto", "ram", "disk", "live")
DISK_HEADROOM = 0.9  # leave a tenth of the free space to everything else


def default_budget_bytes() -> int:
    """A quarter of this machine's physical memory (the RAM cache also sits in Ray's object store)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def choose_reference_cache(nbytes: int, budget_bytes: int, disk_free_bytes: int | None, requested: str = "auto") -> str:
    """ram, disk or live. auto: RAM within the budget, else disk where its free space holds the cache with
    headroom (None: no disk folder given), else live. An explicit request is honoured."""
    if requested not in CACHE_CHOICES:
        raise ValueError(f"reference cache must be one of {', '.join(CACHE_CHOICES)}, not {requested!r}")
    if requested != "auto":
        return requested
    if nbytes <= budget_bytes:
        return "ram"
    if disk_free_bytes is not None and nbytes <= disk_free_bytes * DISK_HEADROOM:
        return "disk"
    return "live"


def disk_free_bytes(folder: str | Path) -> int:
    """Free space where `folder` is (or would be created)."""
    path = Path(folder)
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def storage_dtype(precision: str, device_type: str = "cpu") -> torch.dtype:
    return torch.float16 if uses_bf16(precision, device_type) else torch.float32


def compute_reference_states(reference: torch.nn.Module, encoded: EncodedPairs, layers: list[int], pad_token_id: int,
                             *, batch_size: int = 32, precision: str = "auto",
                             into: str | Path | None = None) -> ReferenceStates:
    """One forward pass of the frozen reference over every training sequence, keeping anchored positions.

    Use the training run's `precision`, so that the cached states are what the uncached loop would compute;
    it also picks the storage precision (fp16 with bf16, fp32 with fp32; see the module docstring).
    `into`: a folder for a disk cache (DiskReferenceStates); a cache of the same sequences, layers and
    storage precision already there is reused, not computed again.
    """
    # FSDP2 sets up a sharded model's state lazily at its first forward pass; under inference mode that state would
    # be inference tensors, which training then cannot use (the drift probe reads a sharded student before it
    # trains): no_grad there, inference mode elsewhere.
    from anchor_rm.model.sharded import is_sharded

    with torch.no_grad() if is_sharded(reference) else torch.inference_mode():
        reference.eval()
        device = next(reference.parameters()).device
        storage = storage_dtype(precision, device.type)
        layers, digest = sorted(layers), encoded_digest(encoded)
        # Only a disk cache is looked up by model; a sharded (FSDP2) model's parameters are not read here.
        model = model_fingerprint(reference) if into is not None else None
        if into is not None:
            found = _reusable(into, digest, layers, storage, model)
            if found is not None:
                return found
        sequences = encoded.chosen + encoded.rejected
        sink = (_DiskWriter(into, anchored_positions(encoded), layers, reference.config.hidden_size, storage, model)
                if into else None)
        states: dict[int, list[torch.Tensor | None]] = {layer: [None] * len(sequences) for layer in layers}
        for batch_indices in length_sorted_batches([len(s.input_ids) for s in sequences], batch_size):
            batch = collate([sequences[i] for i in batch_indices], pad_token_id)
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast(precision, device.type), capture_hidden_states(reference, layers) as hidden:
                reward_forward(reference, batch)  # only the cached layers' states are kept (forward hooks)
            mask = batch["anchor_mask"].bool()
            for layer in layers:
                layer_states = hidden[layer].float()
                for row, seq in enumerate(batch_indices):
                    kept = layer_states[row][mask[row]].to(storage).cpu()
                    if sink is not None:
                        sink.write(layer, seq, kept)
                    else:
                        states[layer][seq] = kept
        if sink is not None:
            return sink.finish(digest, len(encoded))
        return ReferenceStates(layers, states, digest, len(encoded))


def model_fingerprint(model: torch.nn.Module) -> str:
    """Which weights computed a cache: the same sequences through another model (a student of the same tokenizer
    and depth, a --name reused) must not find this model's states. Its name, shape and a sample of its first
    and last parameters, hashed: cheap, and two checkpoints differ there."""
    params = list(model.parameters())
    digest = hashlib.sha256(f"{getattr(model.config, '_name_or_path', '')}|{sum(p.numel() for p in params)}".encode())
    for p in (params[0], params[-1]):
        digest.update(p.detach().float().flatten()[:4096].cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _reusable(folder: str | Path, digest: str, layers: list[int], storage: torch.dtype,
              model: str) -> DiskReferenceStates | None:
    """The cache already in `folder` when it holds these sequences' states, of these layers, from this model, in
    this precision, every layer's file whole; else None (computed again over it)."""
    if not (Path(folder) / INDEX_FILE).exists():
        return None
    try:
        found = open_reference_states(folder)
        index = json.loads((Path(folder) / INDEX_FILE).read_text())
    except ValueError:  # written by something else, or damaged
        return None
    same = (found.digest == digest and found.layers == layers and found.dtype == str(storage).removeprefix("torch.")
            and index.get("model") == model)
    size = max(1, found.offsets[-1]) * found.hidden * np.dtype(found.dtype).itemsize
    whole = all((Path(folder) / f"layer_{layer}.bin").is_file()
                and (Path(folder) / f"layer_{layer}.bin").stat().st_size == size for layer in found.layers)
    return found if same and whole else None


class _DiskWriter:
    """Writes a disk cache into <folder>.partial and renames it into place when complete: a crash leaves no
    folder that looks finished."""

    def __init__(self, folder: str | Path, positions: list[int], layers: list[int], hidden: int, storage: torch.dtype,
                 model: str):
        self.folder, self.partial, self.model = Path(folder), Path(f"{folder}.partial"), model
        shutil.rmtree(self.partial, ignore_errors=True)
        self.partial.mkdir(parents=True)
        self.offsets = np.concatenate([[0], np.cumsum(positions)]).astype(np.int64).tolist()
        self.layers, self.hidden, self.dtype = layers, hidden, str(storage).removeprefix("torch.")
        rows = max(1, self.offsets[-1])
        self.maps = {layer: np.memmap(self.partial / f"layer_{layer}.bin", dtype=self.dtype, mode="w+", shape=(rows, hidden))
                     for layer in layers}

    def write(self, layer: int, seq: int, states: torch.Tensor) -> None:
        self.maps[layer][self.offsets[seq]:self.offsets[seq + 1]] = states.numpy()

    def finish(self, digest: str, num_pairs: int) -> DiskReferenceStates:
        for m in self.maps.values():
            m.flush()
        self.maps.clear()
        index = {"digest": digest, "num_pairs": num_pairs, "layers": self.layers, "hidden": self.hidden,
                 "dtype": self.dtype, "offsets": self.offsets, "model": self.model}
        (self.partial / INDEX_FILE).write_text(json.dumps(index))
        # The old cache is moved aside before the new one moves in, then removed: a kill in between leaves no
        # cache (computed again) or the old one aside, never an index whose layer files are half deleted.
        retired = Path(f"{self.folder}.retired")
        shutil.rmtree(retired, ignore_errors=True)
        if self.folder.exists():
            self.folder.rename(retired)
        self.partial.rename(self.folder)
        shutil.rmtree(retired, ignore_errors=True)
        return open_reference_states(self.folder)
