"""The frozen reference's hidden states, computed once per dataset instead of once per step.

The reference model is frozen and the training inputs are fixed, so its hidden states at the anchored
layers are the same every epoch of every trial. ANCHOR only compares states on anchored positions (response tokens and
the head's read position, encoding.py), so only those are kept: about 1/7 of full fp32 states on HH (27% of tokens are responses), in half precision when
training runs under bf16 autocast (another half). One pass over the training pairs replaces a reference
forward pass in every training step.

Precision: the cache is computed in the training run's precision (anchor_rm/precision.py). Under bf16
autocast the student's own states carry bf16 rounding (about 4e-3 relative), so fp16 storage of the
reference (about 5e-4) adds nothing that matters. In fp32 the states are kept in fp32, so that an fp32 run's
anchor term is the uncached one (tests/test_training.py), not one computed against states rounded to fp16.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from anchor_rm.encoding import collate
from anchor_rm.precision import autocast, uses_bf16
from anchor_rm.scoring import EncodedPairs, length_sorted_batches, reward_forward


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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for per_layer in self.states.values() for t in per_layer)

    def batch(self, pair_indices: list[int], layers: list[int], anchor_mask: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """States laid out like a training batch (chosen rows, then rejected rows), zero off the response.

        The anchor term multiplies every position by the response mask, so the zeros never count.
        """
        missing = [layer for layer in layers if layer not in self.states]
        if missing:
            raise ValueError(f"reference cache holds layers {self.layers}, not {missing}")
        rows = list(pair_indices) + [self.num_pairs + i for i in pair_indices]
        out = []
        for layer in layers:
            first = self.states[layer][rows[0]]
            full = torch.zeros((len(rows), anchor_mask.shape[1], first.shape[-1]), dtype=dtype)
            for r, seq in enumerate(rows):
                positions = anchor_mask[r].nonzero(as_tuple=True)[0]
                full[r, positions] = self.states[layer][seq].to(dtype)
            out.append(full.to(anchor_mask.device))
        return out


@torch.inference_mode()
def compute_reference_states(reference: torch.nn.Module, encoded: EncodedPairs, layers: list[int], pad_token_id: int,
                             *, batch_size: int = 32, precision: str = "auto") -> ReferenceStates:
    """One forward pass of the frozen reference over every training sequence, keeping anchored positions.

    Use the training run's `precision`, so that the cached states are what the uncached loop would compute;
    it also picks the storage precision (fp16 with bf16, fp32 with fp32; see the module docstring).
    """
    reference.eval()
    device = next(reference.parameters()).device
    storage = torch.float16 if uses_bf16(precision, device.type) else torch.float32
    sequences = encoded.chosen + encoded.rejected
    states: dict[int, list[torch.Tensor | None]] = {layer: [None] * len(sequences) for layer in layers}
    for batch_indices in length_sorted_batches([len(s.input_ids) for s in sequences], batch_size):
        batch = collate([sequences[i] for i in batch_indices], pad_token_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast(precision, device.type):
            hidden = reward_forward(reference, batch, output_hidden_states=True).hidden_states
        mask = batch["anchor_mask"].bool()
        for layer in layers:
            layer_states = hidden[layer].float()
            for row, seq in enumerate(batch_indices):
                states[layer][seq] = layer_states[row][mask[row]].to(storage).cpu()
    return ReferenceStates(sorted(layers), states, encoded_digest(encoded), len(encoded))
