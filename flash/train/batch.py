"""Groups of samples → padded tensors the trainer and the losses read.

Layout: each row is ``prompt + response`` right-padded to the longest row. Token-level tensors are
``[N, L-1]`` and aligned with *targets*: column ``j`` scores token ``j+1`` given tokens ``0..j``,
so a response token at sequence position ``p`` lives in column ``p-1``. ``mask`` is 1 exactly on
response-token columns whose ``Sample.loss_mask`` is 1 (all of them when it is None; observation
tokens of a multi-turn episode are 0); ``behav_logp`` and ``versions`` are filled on every
response-token column and zero elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flash.buffers.types import Group, Sample


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [N, L] long
    attention_mask: torch.Tensor  # [N, L] long
    mask: torch.Tensor  # [N, L-1] float, 1 on response tokens
    behav_logp: torch.Tensor  # [N, L-1] float
    versions: torch.Tensor  # [N, L-1] long
    rewards: torch.Tensor  # [N] float
    group_ids: torch.Tensor  # [N] long

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def rows(self, start: int, stop: int, length: int | None = None) -> TrainBatch:
        """Rows ``start:stop``, trimmed to the longest of them (micro-batches stay small);
        ``length``: that longest length when the caller knows it (no read of the mask then)."""
        if length is None:
            length = int(self.attention_mask[start:stop].sum(dim=1).max())
        return TrainBatch(
            input_ids=self.input_ids[start:stop, :length],
            attention_mask=self.attention_mask[start:stop, :length],
            mask=self.mask[start:stop, : length - 1],
            behav_logp=self.behav_logp[start:stop, : length - 1],
            versions=self.versions[start:stop, : length - 1],
            rewards=self.rewards[start:stop],
            group_ids=self.group_ids[start:stop],
        )


def batch_to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """``batch`` with every tensor on ``device`` (the same tensors when already there). An upload
    to a GPU is queued on its stream (non-blocking: the host does not wait for it, and kernels
    queued after it see the data); a copy to the host blocks, so its values are there on return."""
    return TrainBatch(**{k: to_device(v, device) for k, v in vars(batch).items()})


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: non-blocking towards a GPU, blocking towards the host (see ``batch_to``)."""
    return t.to(device, non_blocking=torch.device(device).type == "cuda")


def flatten(groups: list[Group]) -> list[Sample]:
    """Samples in batch order: groups by prompt id, samples by index (deterministic)."""
    out: list[Sample] = []
    for group in sorted(groups, key=lambda g: g.prompt_id):
        out.extend(sorted(group.samples, key=lambda s: s.sample_index))
    return out


def collate(samples: list[Sample], pad_id: int = 0) -> TrainBatch:
    n = len(samples)
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    length = max(length, 2)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    mask = torch.zeros((n, length - 1))
    behav = torch.zeros((n, length - 1))
    versions = torch.zeros((n, length - 1), dtype=torch.long)
    for i, s in enumerate(samples):
        seq = list(s.prompt_ids) + list(s.response_ids)
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, : len(seq)] = 1
        first, last = len(s.prompt_ids) - 1, len(seq) - 1  # target columns of the response
        if len(s.response_ids):  # a list, or a NumPy array from the buffer service
            mask[i, first:last] = 1.0 if s.loss_mask is None else _loss_mask(s)
            behav[i, first:last] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
            versions[i, first:last] = torch.tensor(s.versions, dtype=torch.long)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        mask=mask,
        behav_logp=behav,
        versions=versions,
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([s.prompt_id for s in samples], dtype=torch.long),
    )


def _loss_mask(s: Sample) -> torch.Tensor:
    """The sample's per-response-token loss mask as floats; its length must match the response."""
    if len(s.loss_mask) != len(s.response_ids):
        raise ValueError(
            f"sample {s.prompt_id}:{s.sample_index}: loss_mask has {len(s.loss_mask)} entries "
            f"for {len(s.response_ids)} response tokens"
        )
    return torch.tensor(s.loss_mask, dtype=torch.float32)


def response_starts(mask: torch.Tensor) -> torch.Tensor:
    """Each row's first column of ``mask`` (``[N, L-1]``) that counts, as ``[N]`` longs; the
    width for a row with none. Columns before it carry no loss: logprobs start there."""
    columns = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask > 0, columns, mask.shape[1]).amin(dim=1)
