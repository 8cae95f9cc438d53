"""Ignite handler: the bi-level TRA policy update of SPEC §4, every N iterations."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import torch
from ignite.engine import Engine, Events
from torch import nn

from jcsaug.data.volume_stats import batch_volume_stats
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
    HYPERGRADIENTS,
    flat_dot,
    flat_norm,
    get_hypergradient,
    normalise_hypergradient,
    trainable_parameters,
    training_gradient,
)
from jcsaug.engine.lookahead import NeumannLookAhead
from jcsaug.engine.losses import PerSampleLoss, chunked_loss, get_loss, main_output
from jcsaug.ops.intensity import VolumeStats
from jcsaug.ops.tea import apply_tea_ops
from jcsaug.policy.cascade import COUNTERFACTUAL_SUFFIX, DEFAULT_CF_OP_KEY
from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.registry import Registry

__all__ = [
    "HYPERGRADIENTS",
    "TRA_DIRECTIONS",
    "TRA_ESTIMATORS",
    "TRAPolicyUpdater",
    "tea_transform_batch",
    "without_component",
]

#: how the per-sample hypergradients become a policy gradient (see :class:`TRAPolicyUpdater`)
TRA_ESTIMATORS: Registry[str] = Registry(
    "TRA estimator",
    {
        "gumbel": "straight-through Gumbel weights of the drawn ops (the paper's)",
        "paired": "each drawn op scored against its series' identity on the same patch (counterfactual copies)",
    },
)

#: which direction the training samples' gradients are scored against (see :class:`TRAPolicyUpdater`)
TRA_DIRECTIONS: Registry[str] = Registry(
    "TRA scoring direction",
    {
        "validation": "v, the gradient of the validation loss (after the look-ahead, if any): the paper's",
        "beyond-training": "v without its component along the training batch's own gradient (beyond the paper)",
    },
)


def without_component(v: Mapping[str, torch.Tensor], g: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``v - (v . g / |g|^2) g``: ``v`` with its component along ``g`` removed (``v`` itself when ``g`` is 0)."""
    g_norm2 = flat_norm(g) ** 2
    if not bool(torch.isfinite(g_norm2)) or float(g_norm2) == 0.0:
        return dict(v)
    c = float(flat_dot(v, g) / g_norm2)
    return {k: v[k] - c * g[k].to(v[k].dtype) for k in v}


def tea_transform_batch(
    image: torch.Tensor,
    label: torch.Tensor,
    tea_policy: CategoricalPolicy,
    ops: Sequence,
    generator: torch.Generator,
    stats: VolumeStats | None = None,
    share: float = 1.0,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Transform each validation sample by a TEA op drawn from ``tea_policy`` (image and label together).

    The ops of all samples run batched on the batch's device (:func:`jcsaug.ops.tea.apply_tea_ops`; ``stats``: the
    samples' volumes' intensity statistics, :func:`jcsaug.data.batch_volume_stats`). ``share`` < 1 draws from the
    policy for that share of the samples on average and leaves the rest as they are (the catalogue's identity op:
    the policy's probabilities mixed with it). Returns ``(image, label)`` mini-batches of equal shapes (90-degree
    rotations of non-cubic patches change shapes)."""
    probs = tea_policy.probabilities()[0][0]
    if share < 1.0:
        identity = next((k for k, op in enumerate(ops) if op.kind == "identity"), None)
        if identity is None:
            raise ValueError(f"tea_transform_batch: share={share} needs an identity op in the TEA catalogue")
        probs = share * probs
        probs[identity] += 1.0 - share
    drawn = torch.multinomial(probs, image.shape[0], replacement=True, generator=generator)
    chosen = [ops[k] for k in drawn.tolist()]
    images, labels = apply_tea_ops(chosen, image, "image", stats), apply_tea_ops(chosen, label, "label")
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

    Two estimators turn the per-sample hypergradients into a policy gradient:

    * ``"gumbel"`` — the paper's: class-group centring, sampling-frequency normalisation, and the gradient of
      the conditional Gumbel-softmax straight-through weights of the recorded ops (SPEC §4 steps 4-6).
    * ``"paired"`` — paired (counterfactual) scoring, beyond the paper: the pipeline's ``TRACascaded`` also
      makes ``counterfactuals`` copies of each sample that differ in one series (the drawn op replaced by the
      identity, or an unexplored op put in place of the identity; with ``exploration="uniform"`` an explored op
      is scored against its pair's copy with the identity); each copy is scored at ``theta ± eps v``
      too, and the difference on the same patch is the op's effect on the validation loss, free of the
      patch-to-patch noise. The gradient is the exact softmax gradient of the expected effect
      (:class:`jcsaug.engine.paired.OpEffects`); only the scored ops and their series' identities step.
      Effects are scale-free (the hypergradient divided by ``alpha * ||v||``) and per class group, so no
      centring is needed and a batch with one class group still updates.

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
        val_loss: L_val by name (``ce``, ``dice`` — the mean of per-sample soft Dice losses —, ``ce+dice``,
            ``batch-dice`` — one soft Dice over the whole validation batch, as the reference code —,
            ``ce+batch-dice``) or callable.
        hypergradient: estimator name (:func:`~jcsaug.engine.hypergradient.list_hypergradients`):
            ``"finite-difference"`` (DARTS, the paper's), ``"jvp"`` (exact, forward-mode) or ``"equal-norm"``
            (beyond the paper, a research setting: each sample's gradient rescaled to the batch's mean length, so
            only its direction counts; one backward pass per sample).
        estimator: ``"gumbel"`` (the paper's) or ``"paired"`` (needs ``TRACascaded(counterfactuals=K)``).
        val_batches: validation batches per update; ``v`` is the gradient of their mean loss (a larger
            validation sample, less noise in ``v``).
        val_average: weight of this update's validation gradient in a running average of ``v`` over updates
            (``v <- (1 - a) v + a v_new``); 1 (default) uses this update's alone. A cheaper way to a larger
            validation sample than ``val_batches`` (no extra passes), at the price of older ``theta*``.
        tea_policy: in joint mode, the TEA policy whose ops transform the validation batch.
        tea_share: the share of the validation samples ``tea_policy``'s ops transform, on average (1: all, as the
            paper's joint mode; the others are scored as they are).
        tea_ops: the TEA catalogue (default :data:`jcsaug.ops.tea.TEA_OPS`).
        meta_mode: ``"eval"`` runs the extra passes with the network in eval mode (deterministic
            dropout, BatchNorm's running statistics); ``"train"`` in training mode (dropout, BatchNorm's batch
            statistics), with the same dropout masks at ``theta + eps v`` and ``theta - eps v`` and the network's
            buffers (BatchNorm's running statistics) put back as they were after the update. Only ``"train"``
            scores a deep-supervision network's heads weighted as its training loss weights them (in eval mode it
            gives its main head alone).
        prepare_batch: ``(batch, device) -> (image, label)``.
        mask_undrawn: ops that no sample of a class group drew keep their logits and Adam state (see
            :meth:`PolicyUpdater.step`); ``False`` keeps the plain Gumbel-softmax gradient (``"gumbel"`` only).
        logit_budget: derive ``lr`` from the run's length (see :class:`PolicyUpdater`).
        cf_op_key: where ``TRACascaded`` stored the counterfactuals' (series, op) pairs (``"paired"``).
        effect_smoothing: weight of a new measurement in an op's running effect estimate (``"paired"``).
        lookahead: horizon, in updates, of the look-ahead beyond one training step (beyond the paper):
            ``v`` is replaced by a running Neumann series ``u = sum_j (I - alpha H)^j v`` over about that many
            updates (:class:`jcsaug.engine.lookahead.NeumannLookAhead`: three more forward-backward passes of
            the training batch per update), so ops are scored by their effect on the validation loss over several
            steps, not just the next one. 1 (default) keeps the one-step estimate.
        lookahead_step: the Neumann step ``alpha`` times the largest curvature of the training loss (in (0, 2)).
        direction: what the samples' training gradients are scored against (:data:`TRA_DIRECTIONS`):
            ``"validation"`` (default, the paper's) ``v`` itself (or the look-ahead's ``u``); ``"beyond-training"``
            (beyond the paper) ``v`` without its component along the gradient of the training batch's mean loss
            (one more forward-backward pass of the batch per update, none with the look-ahead, which has
            computed that gradient already). Most of ``v`` is the progress any step on
            source patches makes (on the synthetic zoom shift ``v`` and the plain source gradient have a cosine
            of ~0.7): an op is credited for what it adds beyond it, not for a larger step along it.
        start: the share of the run before the first update (a warm-up; see :class:`PolicyUpdater`).
        step_rule: how the op effects move the logits, a name of :data:`~jcsaug.engine.base.POLICY_STEPS`
            (paired only; see :class:`PolicyUpdater`).
        pull: how far the logits fade back to the initial policy (the preset) over the run, in e-folds (0: never;
            see :class:`PolicyUpdater`).

    Example: attached to your own Ignite loop (batches from a pipeline with ``ClassGroupd`` and ``TRACascaded``,
    which record ``class_group`` and ``tra_ops``)::

        >>> import torch
        >>> from ignite.engine import Engine
        >>> from monai.networks.nets import UNet
        >>> from jcsaug.policy import make_tra_policy
        >>> _ = torch.manual_seed(0)
        >>> net = UNet(3, 1, 2, channels=(4, 8), strides=(2,))
        >>> optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
        >>> image = torch.randn(4, 1, 16, 16, 16)
        >>> label = (image > 1).float()
        >>> batch = {"image": image, "label": label, "class_group": torch.tensor([0, 1, 0, 1]),
        ...          "tra_ops": torch.randint(0, 2, (4, 15))}
        >>> def step(engine, batch):  # your training step
        ...     optimizer.zero_grad()
        ...     torch.nn.functional.cross_entropy(net(batch["image"]), batch["label"][:, 0].long()).backward()
        ...     optimizer.step()
        >>> trainer = Engine(step)
        >>> policy = make_tra_policy("nnunet", num_groups=2)
        >>> updater = TRAPolicyUpdater(policy, net, [{"image": image, "label": label}], optimizer, lr=0.01)
        >>> updater.attach(trainer)
        >>> _ = trainer.run([batch] * 2, max_epochs=1)
        >>> updater.updates, updater.skipped
        (2, 0)
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
        hypergradient: str = "finite-difference",
        tea_policy: CategoricalPolicy | None = None,
        tea_ops: Sequence | None = None,
        tea_share: float = 1.0,
        op_key: str = "tra_ops",
        group_key: str = "class_group",
        image_key: str = "image",
        label_key: str = "label",
        meta_mode: Literal["eval", "train"] = "eval",
        prepare_batch: PrepareBatch | None = None,
        poly_power: float = 0.9,
        seed: int = 0,
        mask_undrawn: bool = True,
        estimator: Literal["gumbel", "paired"] = "gumbel",
        val_batches: int = 1,
        val_average: float = 1.0,
        logit_budget: float | None = None,
        cf_op_key: str = DEFAULT_CF_OP_KEY,
        effect_smoothing: float = 0.1,
        lookahead: float = 1,
        lookahead_step: float = 0.5,
        direction: str = "validation",
        start: float = 0.0,
        step_rule: str = "adam",
        planned_epochs: int | None = None,
        pull: float = 0.0,
    ) -> None:
        super().__init__(
            policy, model, lr, update_every, poly_power, seed, name="TRA", logit_budget=logit_budget,
            frequency_scaling=estimator == "paired", start=start, step_rule=step_rule, planned_epochs=planned_epochs,
            pull=pull,
        )  # fmt: skip
        self.mask_undrawn = mask_undrawn
        TRA_ESTIMATORS.key(estimator)  # an unknown name: an error listing the valid ones
        if int(val_batches) < 1:
            raise ValueError(f"val_batches must be >= 1, got {val_batches}")
        self.estimator = estimator
        self.val_batches = int(val_batches)
        if not 0.0 < float(val_average) <= 1.0:
            raise ValueError(f"val_average must be in (0, 1], got {val_average}")
        self.val_average = float(val_average)
        self._v_average: dict[str, torch.Tensor] | None = None
        if float(lookahead) < 1:
            raise ValueError(f"lookahead must be >= 1 update, got {lookahead}")
        self.lookahead = NeumannLookAhead(lookahead, lookahead_step) if float(lookahead) > 1 else None
        self.direction = TRA_DIRECTIONS.key(direction)  # an unknown name: an error listing the valid ones
        self.cf_op_key = cf_op_key
        self.effects = self._paired_effects(estimator, effect_smoothing)
        if meta_mode not in ("eval", "train"):
            raise ValueError(f"meta_mode must be 'eval' or 'train', got {meta_mode!r}")
        self._settings.update(
            estimator=estimator, hypergradient=str(hypergradient), val_batches=self.val_batches,
            val_average=self.val_average, lookahead=float(lookahead), meta_mode=meta_mode, direction=self.direction,
        )  # fmt: skip
        self.val_stream = ValidationStream(val_loader)
        self.model_optimizer = optimizer
        self.train_loss = get_loss(train_loss)
        #: L_val over the ``(logits, label)`` chunks of one validation batch (a batch loss or a per-sample mean)
        self.val_loss = chunked_loss(val_loss)
        self.hypergradient = get_hypergradient(hypergradient)
        self.tea_policy = tea_policy
        if not 0.0 < float(tea_share) <= 1.0:
            raise ValueError(f"TRAPolicyUpdater: tea_share must be in (0, 1], got {tea_share}")
        self.tea_share = float(tea_share)
        # the share of the validation samples under TEA ops (a file saved before shares stored True / False)
        self._settings["val_tea"] = self.tea_share if tea_policy is not None else 0.0
        if tea_policy is not None and tea_ops is None:
            from jcsaug.ops.tea import TEA_OPS

            tea_ops = TEA_OPS
        self.tea_ops = tea_ops
        self.op_key, self.group_key = op_key, group_key
        self.image_key, self.label_key = image_key, label_key
        self.meta_mode = meta_mode
        self.prepare_batch = prepare_batch or make_prepare_batch(image_key, label_key)
        self._theta: dict[str, torch.Tensor] | None = None
        self._alpha = 0.0

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.ITERATION_STARTED(every=self.update_every), self._snapshot)
        super().attach(engine)

    def _snapshot(self, engine: Engine) -> None:
        """Keep ``theta`` and the step size of the coming model step (update iterations only)."""
        if self.warming_up(engine):
            return
        self._theta = {n: p.detach().clone() for n, p in trainable_parameters(self.model).items()}
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

    def _validation_loss(self, chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return self.val_loss([(main_output(self.model(x)), y) for x, y in chunks])

    def _validation_gradient(self) -> dict[str, torch.Tensor]:
        """``v``: the gradient of the mean validation loss over ``val_batches`` batches, at ``theta*``."""
        params = trainable_parameters(self.model)
        total: list[torch.Tensor] | None = None
        for _ in range(self.val_batches):
            batch = self.val_stream.next()
            if batch is None:
                raise SkipUpdate("the validation loader is empty")
            image, label = self.prepare_batch(batch, self.device)
            if self.tea_policy is not None:
                stats = batch_volume_stats(batch, self.image_key)
                chunks = tea_transform_batch(
                    image, label, self.tea_policy, self.tea_ops, self.generator, stats, self.tea_share
                )
            else:
                chunks = [(image, label)]
            loss = self._validation_loss(chunks) / self.val_batches
            if not torch.isfinite(loss):
                raise SkipUpdate("non-finite validation loss")
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            grads = [g if g is not None else torch.zeros_like(p) for p, g in zip(params.values(), grads)]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        v = dict(zip(params, total))
        if self.val_average < 1.0:
            if self._v_average is not None and self._v_average.keys() == v.keys():
                a = self.val_average
                v = {k: (1 - a) * self._v_average[k].to(g.device) + a * g for k, g in v.items()}
            self._v_average = {k: g.detach().clone() for k, g in v.items()}
        return v

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self._v_average is not None:
            state["val_gradient_average"] = {k: v.cpu() for k, v in self._v_average.items()}
        if self.lookahead is not None:
            state["lookahead"] = self.lookahead.state_dict()
        return state

    def load_state_dict(self, state: Mapping) -> None:
        super().load_state_dict(state)
        average = state.get("val_gradient_average")
        self._v_average = None if average is None else {k: v.to(self.device) for k, v in average.items()}
        if self.lookahead is not None and "lookahead" in state:
            self.lookahead.load_state_dict(state["lookahead"], self.device)

    def _look_ahead(
        self, v: dict[str, torch.Tensor], image: torch.Tensor, label: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``v`` -> the look-ahead direction ``u`` (the training batch gives the curvature)."""
        try:
            return self.lookahead(self.model, v, image, label, self.train_loss)
        except FloatingPointError as err:
            self.lookahead.load_state_dict({})  # start the series again
            raise SkipUpdate(str(err)) from err

    def _training_gradient(self, image: torch.Tensor, label: torch.Tensor) -> dict[str, torch.Tensor]:
        """The gradient of the training batch's mean loss at the network's present parameters (those of ``v``).

        The look-ahead, when on, has just computed it (the base of its finite differences): taken from there, one
        forward-backward pass of the batch per update fewer (in ``meta_mode: train`` with the look-ahead's dropout
        masks, an estimate as good as a fresh draw's)."""
        if self.lookahead is not None and self.lookahead.gradient is not None:
            return self.lookahead.gradient
        try:
            return training_gradient(self.model, image, label, self.train_loss)
        except FloatingPointError as err:
            raise SkipUpdate(str(err)) from err

    def _counterfactuals(self, batch: Mapping, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(images [n*K, ...], labels [n*K, ...], cf_ops [n, K, 2])`` made by ``TRACascaded(counterfactuals=K)``."""
        keys = [self.cf_op_key, self.image_key + COUNTERFACTUAL_SUFFIX, self.label_key + COUNTERFACTUAL_SUFFIX]
        missing = [k for k in keys if k not in batch]
        if missing:
            raise KeyError(
                f"the paired estimator needs the counterfactual copies {missing} in the training batch: build the "
                "pipeline's TRACascaded with counterfactuals=K (K >= 1)"
            )
        cf_ops = plain(torch.as_tensor(batch[self.cf_op_key])).long().cpu()
        images = plain(batch[keys[1]]).to(self.device)
        labels = plain(batch[keys[2]]).to(self.device)
        if cf_ops.ndim != 3 or cf_ops.shape[0] != n or images.shape[:2] != cf_ops.shape[:2]:
            raise ValueError(
                f"counterfactuals of shapes {tuple(cf_ops.shape)} / {tuple(images.shape)} for a batch of {n}"
            )
        return images.flatten(0, 1), labels.flatten(0, 1), cf_ops

    def update(self, engine: Engine) -> None:
        if self._theta is None:
            raise SkipUpdate("no parameter snapshot (handler attached after the iteration started)")
        batch = as_batch(engine.state.batch)
        choices, groups = self._choices_and_groups(batch)
        paired = self.estimator == "paired"
        if not paired and self.policy.num_groups > 1 and groups.unique().numel() < 2:
            raise SkipUpdate("the training batch holds one class group only")
        image, label = self.prepare_batch(batch, self.device)
        n = image.shape[0]
        train_image, train_label = image, label
        if paired:
            cf_images, cf_labels, cf_ops = self._counterfactuals(batch, n)
            image, label = torch.cat([image, cf_images]), torch.cat([label, cf_labels.to(label.dtype)])
        was_training = self.model.training
        self.model.train(self.meta_mode == "train")
        # in training mode the extra passes (validation, look-ahead, theta ± eps v) would update BatchNorm's running
        # statistics: the network the trainer trains gets its buffers back as they were
        saved = [(b, b.clone()) for b in self.model.buffers()] if self.meta_mode == "train" else []
        try:
            v = self._validation_gradient()
            if self.lookahead is not None:
                v = self._look_ahead(v, train_image, train_label)
            if self.direction == "beyond-training":
                v = without_component(v, self._training_gradient(train_image, train_label))
            norm = flat_norm(v)
            if not torch.isfinite(norm) or norm == 0:
                raise SkipUpdate(f"validation gradient norm is {float(norm)}")
            g = self.hypergradient(self.model, self._theta, v, image, label, self.train_loss, self._alpha, v_norm=norm)
        finally:
            self.model.train(was_training)
            self._theta = None
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)
        if not torch.isfinite(g).all():
            raise SkipUpdate("non-finite training loss at theta ± eps v")
        if paired:
            # scale-free per-sample scores: dL_val/dw_i / (alpha ||v||) * batch size = -grad l_i . v/||v||
            scores = g.cpu() * image.shape[0] / (max(self._alpha, 1e-12) * float(norm))
            self._paired_step(engine, scores[:n], scores[n:].reshape(cf_ops.shape[:2]), choices, groups, cf_ops)
            return
        coefficients = normalise_hypergradient(g.cpu(), groups, choices)
        weights = self.policy.series_weights(choices, groups, self.generator)
        drawn = self.policy.drawn_mask(choices, groups) if self.mask_undrawn else None
        self.step(engine, (coefficients.to(weights.dtype) * weights).sum(), drawn)

    @staticmethod
    def _identity_scores(
        scores: torch.Tensor, cf_scores: torch.Tensor, series: torch.Tensor, cf_op: torch.Tensor, drawn: torch.Tensor
    ) -> torch.Tensor:
        """``[n, K]``: for each copy that explores an op, the score of its patch with the identity in that series:
        the sample's own where it drew the identity there, else the sample's copy with the identity in that
        series (``TRACascaded(exploration="uniform")`` makes one beside every such copy)."""
        reference = scores[:, None].expand_as(cf_scores).clone()
        for i, k in ((cf_op != 0) & (drawn != 0)).nonzero().tolist():
            (identity,) = ((series[i] == series[i, k]) & (cf_op[i] == 0)).nonzero(as_tuple=True)
            if identity.numel() == 0:
                raise ValueError(
                    f"counterfactual copy {k} of sample {i} applies op {int(cf_op[i, k])} of series "
                    f"{int(series[i, k])}, where the sample drew op {int(drawn[i, k])}, and no copy of the sample has "
                    "the identity there to score it against"
                )
            reference[i, k] = cf_scores[i, identity[0]]
        return reference

    def _paired_step(
        self,
        engine: Engine,
        scores: torch.Tensor,
        cf_scores: torch.Tensor,
        choices: torch.Tensor,
        groups: torch.Tensor,
        cf_ops: torch.Tensor,
    ) -> None:
        """Op effects from the (sample, counterfactual) pairs, then the exact-softmax policy step."""
        series, cf_op = cf_ops[..., 0], cf_ops[..., 1]  # [n, K]
        drawn = choices.gather(1, series)  # the sample's own op in the copy's series
        scored_op = torch.where(cf_op == 0, drawn, cf_op)
        # the op's score minus the identity's, on the same patch with the same other ops
        effect = torch.where(cf_op == 0, scores[:, None] - cf_scores, cf_scores - self._identity_scores(
            scores, cf_scores, series, cf_op, drawn))  # fmt: skip
        group = groups[:, None].expand_as(series)
        sums, counts = self.effects.accumulate(group.reshape(-1), series.reshape(-1), scored_op.reshape(-1),
                                               effect.reshape(-1))  # fmt: skip
        if not bool((counts > 0).any()) and not self.distributed:
            raise SkipUpdate("no counterfactual scored a non-identity op")
        grad, mask = self.effects.gradient(sums, counts)
        self._apply_gradient(engine, grad.to(self.policy.logits.dtype), mask)
