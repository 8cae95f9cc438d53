"""Ignite handler: the bi-level TRA policy update of SPEC §4, every N iterations."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import torch
from ignite.engine import Engine, Events
from torch import nn

from jcsaug.engine.base import (
    PolicyUpdater,
    PrepareBatch,
    SkipUpdate,
    ValidationStream,
    as_batch,
    make_prepare_batch,
    plain,
)
from jcsaug.engine.hypergradient import (
    finite_difference_hypergradient,
    flat_norm,
    jvp_hypergradient,
    normalise_hypergradient,
)
from jcsaug.engine.losses import PerSampleLoss, get_loss, main_output
from jcsaug.ops.tea import apply_tea_ops
from jcsaug.policy.categorical import CategoricalPolicy

HYPERGRADIENTS = {"finite-difference": finite_difference_hypergradient, "jvp": jvp_hypergradient}


def tea_transform_batch(
    image: torch.Tensor,
    label: torch.Tensor,
    tea_policy: CategoricalPolicy,
    ops: Sequence,
    generator: torch.Generator,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Transform each validation sample by a TEA op drawn from ``tea_policy`` (image and label together).

    The ops of all samples run batched on the batch's device (:func:`jcsaug.ops.tea.apply_tea_ops`). Returns
    ``(image, label)`` mini-batches of equal shapes (90-degree rotations of non-cubic patches change shapes)."""
    probs = tea_policy.probabilities()[0][0]
    drawn = torch.multinomial(probs, image.shape[0], replacement=True, generator=generator)
    chosen = [ops[k] for k in drawn.tolist()]
    images, labels = apply_tea_ops(chosen, image, "image"), apply_tea_ops(chosen, label, "label")
    by_shape: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for x, y in zip(images, labels):
        by_shape.setdefault(tuple(x.shape), []).append((x, y))
    return [(torch.stack([x for x, _ in g]), torch.stack([y for _, y in g])) for g in by_shape.values()]


class TRAPolicyUpdater(PolicyUpdater):
    """Learn the (class-specific) TRA policy by one-step unrolled bi-level optimisation (SPEC §4).

    On every ``update_every``-th iteration: the trainer's own step is reused as ``theta -> theta*``
    (``theta`` is snapshotted at the start of that iteration only); then ``v = grad L_val(theta*)`` on a
    validation batch (transformed by ops of ``tea_policy`` in joint mode), the hypergradient of every
    training sample's weight by finite differences at ``theta ± eps v`` (or exactly by a JVP),
    class-group centring, sampling-frequency normalisation, and an Adam step on the policy logits.
    The sample weights come from conditional Gumbel re-sampling of the choices recorded in the batch
    (``op_key``) with the current logits.

    Attach to MONAI's ``SupervisedTrainer`` (``train_handlers=[updater]``) or to any Ignite ``Engine``
    whose ``state.batch`` is a dictionary holding the image, label, ``op_key`` and ``group_key``.

    Args:
        policy: the TRA policy (as used by the pipeline's ``TRACascaded``).
        model: the network the trainer optimises.
        val_loader: validation patches (dictionary batches); an empty one skips updates with a warning.
        optimizer: the model's optimiser; its current lr is the unrolling step size alpha.
        lr: the policy's learning rate beta.
        update_every: N.
        train_loss: per-sample training loss (name in ``ce``/``dice``/``ce+dice`` or a callable); should
            match the loss the trainer minimises.
        val_loss: L_val by name or callable.
        hypergradient: ``"finite-difference"`` (DARTS, the paper's) or ``"jvp"`` (exact, forward-mode).
        tea_policy: in joint mode, the TEA policy whose ops transform the validation batch.
        tea_ops: the TEA catalogue (default :data:`jcsaug.ops.tea.TEA_OPS`).
        meta_mode: ``"eval"`` runs the extra passes with the network in eval mode (deterministic
            dropout, no BatchNorm statistics updates); ``"train"`` keeps the trainer's mode.
        prepare_batch: ``(batch, device) -> (image, label)``.
        mask_undrawn: give ops that no sample of a class group drew a zero gradient (see
            :meth:`PolicyUpdater.step`); ``False`` keeps the plain Gumbel-softmax gradient.
    """

    def __init__(
        self,
        policy: CategoricalPolicy,
        model: nn.Module,
        val_loader: Iterable | None,
        optimizer: torch.optim.Optimizer,
        lr: float = 1e-3,
        update_every: int = 1,
        train_loss: str | PerSampleLoss = "ce+dice",
        val_loss: str | PerSampleLoss = "dice",
        hypergradient: Literal["finite-difference", "jvp"] = "finite-difference",
        tea_policy: CategoricalPolicy | None = None,
        tea_ops: Sequence | None = None,
        op_key: str = "tra_ops",
        group_key: str = "class_group",
        image_key: str = "image",
        label_key: str = "label",
        meta_mode: Literal["eval", "train"] = "eval",
        prepare_batch: PrepareBatch | None = None,
        poly_power: float = 0.9,
        seed: int = 0,
        mask_undrawn: bool = True,
    ) -> None:
        super().__init__(policy, model, lr, update_every, poly_power, seed, name="TRA")
        self.mask_undrawn = mask_undrawn
        if hypergradient not in HYPERGRADIENTS:
            raise KeyError(f"unknown hypergradient {hypergradient!r}; choose one of {sorted(HYPERGRADIENTS)}")
        if meta_mode not in ("eval", "train"):
            raise ValueError(f"meta_mode must be 'eval' or 'train', got {meta_mode!r}")
        self.val_stream = ValidationStream(val_loader)
        self.model_optimizer = optimizer
        self.train_loss = get_loss(train_loss)
        self.val_loss = get_loss(val_loss)
        self.hypergradient = HYPERGRADIENTS[hypergradient]
        self.tea_policy = tea_policy
        if tea_policy is not None and tea_ops is None:
            from jcsaug.ops.tea import TEA_OPS

            tea_ops = TEA_OPS
        self.tea_ops = tea_ops
        self.op_key, self.group_key = op_key, group_key
        self.meta_mode = meta_mode
        self.prepare_batch = prepare_batch or make_prepare_batch(image_key, label_key)
        self._theta: dict[str, torch.Tensor] | None = None
        self._alpha = 0.0

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.ITERATION_STARTED(every=self.update_every), self._snapshot)
        super().attach(engine)

    def _snapshot(self, engine: Engine) -> None:
        """Keep ``theta`` and the step size of the coming model step (update iterations only)."""
        self._theta = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        self._alpha = float(self.model_optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ the update
    def _choices_and_groups(self, batch: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
        if self.op_key not in batch:
            raise KeyError(
                f"batch has no recorded TRA choices {self.op_key!r}: put TRACascaded in the training pipeline"
            )
        choices = plain(batch[self.op_key]).long().cpu()
        if self.policy.num_groups == 1:
            return choices, torch.zeros(len(choices), dtype=torch.long)
        if self.group_key not in batch:
            raise KeyError(f"batch has no class group {self.group_key!r}: put ClassGroupd in the training pipeline")
        return choices, plain(torch.as_tensor(batch[self.group_key])).long().cpu().reshape(-1)

    def _validation_gradient(self) -> dict[str, torch.Tensor]:
        batch = self.val_stream.next()
        if batch is None:
            raise SkipUpdate("the validation loader is empty")
        image, label = self.prepare_batch(batch, self.device)
        if self.tea_policy is not None:
            chunks = tea_transform_batch(image, label, self.tea_policy, self.tea_ops, self.generator)
        else:
            chunks = [(image, label)]
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        total = sum(self.val_loss(main_output(self.model(x)), y).sum() for x, y in chunks) / image.shape[0]
        if not torch.isfinite(total):
            raise SkipUpdate("non-finite validation loss")
        grads = torch.autograd.grad(total, list(params.values()), allow_unused=True)
        return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params.items(), grads)}

    def update(self, engine: Engine) -> None:
        if self._theta is None:
            raise SkipUpdate("no parameter snapshot (handler attached after the iteration started)")
        batch = as_batch(engine.state.batch)
        choices, groups = self._choices_and_groups(batch)
        if self.policy.num_groups > 1 and groups.unique().numel() < 2:
            raise SkipUpdate("the training batch holds one class group only")
        image, label = self.prepare_batch(batch, self.device)
        was_training = self.model.training
        self.model.train(self.meta_mode == "train")
        try:
            v = self._validation_gradient()
            norm = flat_norm(v)
            if not torch.isfinite(norm) or norm == 0:
                raise SkipUpdate(f"validation gradient norm is {float(norm)}")
            g = self.hypergradient(self.model, self._theta, v, image, label, self.train_loss, self._alpha, v_norm=norm)
        finally:
            self.model.train(was_training)
            self._theta = None
        if not torch.isfinite(g).all():
            raise SkipUpdate("non-finite training loss at theta ± eps v")
        coefficients = normalise_hypergradient(g.cpu(), groups, choices)
        weights = self.policy.series_weights(choices, groups, self.generator)
        drawn = self.policy.drawn_mask(choices, groups) if self.mask_undrawn else None
        self.step(engine, (coefficients.to(weights.dtype) * weights).sum(), drawn)
