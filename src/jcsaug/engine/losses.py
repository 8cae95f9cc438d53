"""Per-sample segmentation losses by name (``ce``, ``dice``, ``ce+dice``), built on MONAI and torch.

The policy updates need one loss value per sample (``[B]``); the validation loss is their mean.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from monai.losses import DiceLoss

from jcsaug.networks.factory import deep_supervision_weights
from jcsaug.registry import Registry

PerSampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def main_output(pred: torch.Tensor | list | tuple) -> torch.Tensor:
    """The full-resolution logits of a network output (first head of deep-supervision outputs)."""
    if isinstance(pred, (list, tuple)):
        return pred[0]
    if isinstance(pred, dict):
        raise TypeError("dictionary network outputs are not supported; wrap the network to return logits")
    return pred


def _label_indices(label: torch.Tensor) -> torch.Tensor:
    """``[B, 1, *spatial]`` (or ``[B, *spatial]``) integer labels -> ``[B, *spatial]`` long."""
    if label.ndim >= 2 and label.shape[1] == 1:
        label = label[:, 0]
    return label.long()


def per_sample_ce(logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(logits, _label_indices(label), reduction="none")
    return ce.flatten(1).mean(1)


_DICE = DiceLoss(to_onehot_y=True, softmax=True, include_background=False, reduction="none")


def per_sample_dice(logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Soft Dice loss over the foreground classes, one value per sample (MONAI ``DiceLoss``)."""
    lab = label if label.ndim == logits.ndim else label.unsqueeze(1)
    return _DICE(logits, lab).flatten(1).mean(1)


def per_sample_ce_dice(logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return per_sample_ce(logits, label) + per_sample_dice(logits, label)


def _loss_key(name: str) -> str:
    """``"CE + DSC"`` -> ``"ce+dice"``: case, spaces and the paper's ``DSC`` do not matter."""
    return name.lower().replace(" ", "").replace("dsc", "dice").replace("dicece", "ce+dice")


#: name -> per-sample loss ``(logits [B, C, ...], label [B, 1, ...]) -> [B]``
LOSSES: Registry[PerSampleLoss] = Registry("loss", normalise=_loss_key)
LOSSES.register("ce", per_sample_ce)
LOSSES.register("dice", per_sample_dice)
LOSSES.register("ce+dice", per_sample_ce_dice)


#: ``register_loss(name, loss)`` makes a per-sample loss ``(logits, label) -> [B]`` available by name;
#: ``list_losses()`` the names
register_loss, list_losses = LOSSES.register, LOSSES.names


def batch_dice_loss(chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One soft Dice loss over a whole batch (the reference code's validation loss), mean over foreground classes.

    ``chunks`` are ``(logits [b, C, ...], label [b, 1, ...])`` parts of one batch (90-degree rotations of non-cubic
    patches split a batch by shape). Why by hand: MONAI's ``DiceLoss(batch=True)`` needs one tensor of one shape,
    and the chunks' intersections and sums must be added before the ratio is taken.
    """
    inter = total = None
    for logits, label in chunks:
        probs = torch.softmax(logits.float(), dim=1)[:, 1:]
        onehot = F.one_hot(_label_indices(label), logits.shape[1]).movedim(-1, 1)[:, 1:].to(probs.dtype)
        dims = [0, *range(2, probs.ndim)]
        i, t = (probs * onehot).sum(dims), (probs + onehot).sum(dims)
        inter, total = (i, t) if inter is None else (inter + i, total + t)
    if inter is None:
        raise ValueError("batch_dice_loss needs at least one chunk")
    return (1.0 - (2.0 * inter + 1e-5) / (total + 1e-5)).mean()


def sample_mean(per_sample: PerSampleLoss, chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The mean of a per-sample loss over all samples of a batch given as chunks, whatever the chunks' sizes."""
    return sum(per_sample(out, y).sum() for out, y in chunks) / sum(y.shape[0] for _, y in chunks)


def ce_batch_dice_loss(chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Cross-entropy (the mean over the batch's samples) plus :func:`batch_dice_loss`: the reference code's
    ``CE + Dice`` validation loss."""
    return sample_mean(per_sample_ce, chunks) + batch_dice_loss(chunks)


#: name -> validation loss over a whole batch (a list of same-shape chunks) -> scalar. The dataset bundles' L_val:
#: the paper's "DSC" and "DSC+CE" are these (its code's soft Dice is one Dice over the batch)
BATCH_LOSSES: Registry[Callable[[list[tuple[torch.Tensor, torch.Tensor]]], torch.Tensor]] = Registry(
    "validation batch loss", {"batch-dice": batch_dice_loss, "ce+batch-dice": ce_batch_dice_loss}, normalise=_loss_key
)


def get_loss(name: str | PerSampleLoss) -> PerSampleLoss:
    """The per-sample loss called ``name`` (``ce``, ``dice``, ``ce+dice``; ``DSC`` reads as ``dice``); a callable is
    returned as it is."""
    return name if callable(name) else LOSSES.get(name)


ChunkedLoss = Callable[[list[tuple[torch.Tensor, torch.Tensor]]], torch.Tensor]


def chunked_loss(name: str | PerSampleLoss) -> ChunkedLoss:
    """A validation loss over ``[(logits, label), ...]`` chunks of one batch, by name: a batch loss of
    :data:`BATCH_LOSSES` (``batch-dice``: one soft Dice over all chunks) as it is, else the mean over all samples of
    the per-sample loss :func:`get_loss` gives (the mean over samples, whatever the chunks' sizes)."""
    if isinstance(name, str) and name in BATCH_LOSSES:
        return BATCH_LOSSES.get(name)
    per_sample = get_loss(name)
    return lambda chunks: sample_mean(per_sample, chunks)


def per_sample_training_losses(
    loss_fn: PerSampleLoss, pred: torch.Tensor | list | tuple, label: torch.Tensor
) -> torch.Tensor:
    """Per-sample training losses ``[B]`` of a network output: the heads of a deep-supervision output (a list or
    tuple of full-resolution heads) summed with nnU-Net's weights 1, 1/2, 1/4, ... normalised to 1, a plain output
    as it is. The one definition :class:`SegmentationLoss` (the model's step) and the TRA's hypergradients (the
    losses at theta+-) share, as the reference's per-sample training loss sums the heads too."""
    if isinstance(pred, (list, tuple)):
        weights = deep_supervision_weights(len(pred))
        return sum(w * loss_fn(head, label) for w, head in zip(weights, pred))
    return loss_fn(main_output(pred), label)


class SegmentationLoss(torch.nn.Module):
    """The model's training loss by name (``ce``, ``dice``, ``ce+dice``): the batch mean of the same per-sample
    losses the policy updates use (:func:`per_sample_training_losses`), so training and hypergradients agree. (A
    deep-supervision network gives its heads in training mode only: with the TRA's extra passes in eval mode,
    ``TRAPolicyUpdater(meta_mode="eval")``, the default, they score its main head alone.)

    Deep-supervision outputs (a tuple of full-resolution heads, as :class:`jcsaug.networks.NnUNetDynUNet` returns
    in training mode) are summed with nnU-Net's weights 1, 1/2, 1/4, ... normalised to 1. MONAI's
    ``DeepSupervisionLoss`` is not used because it computes one batch value; the heads here are already at full
    resolution, so nothing else would differ.
    """

    def __init__(self, name: str = "ce+dice") -> None:
        super().__init__()
        self.name = name
        self.per_sample = get_loss(name)

    def forward(self, pred: torch.Tensor | list | tuple, label: torch.Tensor) -> torch.Tensor:
        return per_sample_training_losses(self.per_sample, pred, label).mean()
