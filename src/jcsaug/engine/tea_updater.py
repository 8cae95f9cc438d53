"""Ignite handler: the TEA policy update of SPEC §5, every N iterations."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from ignite.engine import Engine
from monai.inferers import Inferer
from monai.losses import DiceLoss, MaskedDiceLoss
from monai.metrics import compute_dice
from monai.networks.utils import one_hot
from torch import nn

from jcsaug.data.volume_stats import batch_volume_stats
from jcsaug.engine.base import PolicyUpdater, PrepareBatch, SkipUpdate, ValidationStream, make_prepare_batch
from jcsaug.engine.losses import main_output
from jcsaug.inference.tta import IdentityWeight, check_identity_weight, tta_selection
from jcsaug.ops.intensity import VolumeStats
from jcsaug.ops.tea import apply_tea_ops, apply_tea_ops_by_shape, in_view_masks
from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.policy.transforms import centre_class
from jcsaug.registry import Registry

#: how the copies' Dice scores become a policy gradient (see :class:`TEAPolicyUpdater`)
TEA_ESTIMATORS: Registry[str] = Registry(
    "TEA estimator",
    {
        "gumbel": "straight-through Gumbel weights of the drawn ops (the paper's)",
        "paired": "each drawn op's Dice against the untouched copy's, as a running effect per op",
    },
)

#: how one copy's op is scored (see :class:`TEAPolicyUpdater`'s ``op_score``)
TEA_OP_SCORES: Registry[str] = Registry(
    "TEA op score",
    {
        "alone": "the op's mapped-back prediction on its own (the paper's), its softmax probabilities mapped back",
        "alone-logits": "the op's mapped-back prediction on its own, its logits mapped back (as the TTA and the "
        "reference code map them) and then softmax",
        "alone-hard": "the hard Dice (argmax) of the op's mapped-back logits on its own: the segmentation a TTA of "
        "that op alone outputs",
        "with-identity": "the op's mapped-back logits averaged with the untouched copy's, as the TTA ensemble uses it",
        "with-identity-hard": "the hard Dice (argmax) of the op's mapped-back logits averaged with the untouched "
        "copy's: the segmentation the TTA's pair of identity and op outputs",
        "ensemble": "the first-order change of the soft Dice loss of the TTA's current ensemble (the policy's top "
        "ops, their mapped-back logits weighted as the TTA weights them) when weight moves from the identity to "
        "the op",
    },
)

# soft Dice loss over *all* foreground classes (the reference code scores class 1 only: a bug)
_SOFT_DICE = DiceLoss(include_background=False, to_onehot_y=True, softmax=False, reduction="none")
_MASKED_SOFT_DICE = MaskedDiceLoss(include_background=False, to_onehot_y=True, softmax=False, reduction="none")


def soft_dice_loss(probs: torch.Tensor, label: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, C, ...]`` probabilities vs ``[B, 1, ...]`` labels -> ``[B]`` mean foreground soft Dice loss; with a
    ``[B, 1, ...]`` ``mask``, over the voxels it marks only (MONAI's ``MaskedDiceLoss``)."""
    if mask is None:
        return _SOFT_DICE(probs, label).flatten(1).mean(1)
    return _MASKED_SOFT_DICE(probs, label, mask.to(probs.dtype)).flatten(1).mean(1)


def hard_dice_loss(logits: torch.Tensor, label: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, C, ...]`` logits vs ``[B, 1, ...]`` labels -> ``[B]`` one minus the mean foreground Dice of the argmax
    segmentation (a class absent from both label and segmentation counts as Dice 1, absent from one as 0); with a
    ``[B, 1, ...]`` ``mask``, over the voxels it marks only."""
    classes = logits.shape[1]
    pred = one_hot(logits.argmax(1, keepdim=True), classes)
    truth = one_hot(label.long(), classes)
    if mask is not None:
        pred, truth = pred * mask, truth * mask
    return 1.0 - compute_dice(pred, truth, include_background=False, ignore_empty=False).mean(1)


def predict_by_shape(
    model: nn.Module, images: Sequence[torch.Tensor], logits: bool = False, inferer: Inferer | None = None
) -> list[torch.Tensor]:
    """Softmax predictions (``logits``: the logits) of single images ``[C, ...]``; images of equal shape go through
    together, by ``inferer(batch, model)`` when one is given (e.g. MONAI's ``SlidingWindowInferer``), else in one
    pass of ``model``."""
    out: list[torch.Tensor | None] = [None] * len(images)
    by_shape: dict[tuple, list[int]] = {}
    for i, x in enumerate(images):
        by_shape.setdefault(tuple(x.shape), []).append(i)
    for idx in by_shape.values():
        batch = torch.stack([images[i] for i in idx])
        pred = main_output(model(batch) if inferer is None else inferer(batch, model)).float()
        pred = pred if logits else torch.softmax(pred, dim=1)
        for j, i in enumerate(idx):
            out[i] = pred[j]
    return out  # type: ignore[return-value]


class TEAPolicyUpdater(PolicyUpdater):
    """Learn the TEA policy (SPEC §5) from ``patches`` foreground-centred validation patches per update (one, as
    the paper, by default).

    Each patch is copied Z+1 times: copy 0 stays untouched, copies 1..Z are transformed by ops drawn
    from the TEA policy (Gumbel-softmax). The current network predicts each copy (no gradient through
    the network), every prediction (softmax probabilities; ``op_score``: logits) is mapped back by its op's inverse
    and scored by soft Dice against the label over all foreground classes. The loss
    ``sum_k w_k Dice_k / sum_k w_k`` gives centred gradients ``dL/dw_k``, which are divided by how often op k was
    drawn before the Adam step. With several patches the loss is the mean of the patches' losses (each centred on
    its own copies) and the counts are over all patches' copies.

    Estimators:

    * ``"gumbel"`` — the paper's, as above: the copies' ops are drawn from the policy (Gumbel-softmax).
    * ``"paired"`` — beyond the paper: the Z copies' ops are drawn uniformly, without replacement, from the
      non-identity ops, so every op is measured whatever its current probability (a rarely chosen op that
      undoes a domain shift is found); each copy's effect is its Dice loss minus the untouched copy's on the
      same patch, and the gradient is the exact softmax gradient of the expected effect
      (:class:`jcsaug.engine.paired.OpEffects`). Only the measured ops and the identity step.

    Args:
        policy: the TEA policy (84 ops, see :func:`jcsaug.policy.make_tea_policy`).
        model: the network (evaluated in eval mode, its mode restored afterwards).
        val_loader: validation patches (dictionary batches).
        lr: gamma, the policy learning rate.
        num_copies: Z.
        ops: the TEA catalogue (default :data:`jcsaug.ops.tea.TEA_OPS`).
        max_batches: validation batches searched for a foreground-centred patch before skipping (times
            ``1 + background_patches``).
        mask_undrawn: ops not drawn among the Z copies keep their logits and Adam state (see
            :meth:`PolicyUpdater.step`; ``"gumbel"`` only, ``"paired"`` always masks).
        estimator: ``"gumbel"`` (the paper's) or ``"paired"``.
        logit_budget: derive ``lr`` from the run's length (see :class:`PolicyUpdater`).
        patches: foreground-centred validation patches scored per update (each with its own Z copies).
        background_patches: background-centred validation patches scored with each foreground-centred one (beyond
            the paper, whose TEA scores lesion-centred patches only): the same Z ops are applied to each, and every
            copy's score is one Dice pooled over the foreground patch and these (voxel sums over all of them), so an
            op that removes false positives away from the lesion is credited as it is at test time on the whole
            volume (on the default synthetic shift, most of what ``gamma_compress_0.5`` is worth to the heuristic's
            networks: ``benchmarks/README.md``). Every ``op_score`` but ``"ensemble"``; 0 (the default): the
            foreground patch alone.
        effect_smoothing: weight of a new measurement in an op's running effect estimate (``"paired"``).
        op_score: how a copy's op is scored: ``"alone"`` (the paper's: its mapped-back prediction on its own, the
            softmax probabilities mapped back), ``"alone-logits"`` (the same with the logits mapped back and then
            the softmax, as the TTA and the reference code map them back; a research setting: an interpolating
            inverse no longer blurs the lesion border of a zoom out's prediction, so zoom outs score higher, but
            zoom ins too, and the TEA learned alone on the default synthetic shift lost about 6 TTA Dice,
            ``benchmarks/README.md``), ``"alone-hard"`` (the same mapped-back logits scored by the hard Dice of their
            argmax, the segmentation a one-op TTA outputs, so that a softer prediction gains nothing; a research
            setting: with the sliding window ``inferer``, joint runs on one machine gained 8.8 Dice over the
            defaults on a zoom shift and lost 2.3 on the default shift, for a third more time per run,
            ``benchmarks/README.md``) or ``"with-identity"``
            (its mapped-back logits averaged with the untouched copy's, as the TTA ensemble averages them beside the
            identity: an op that helps the ensemble without being better alone, e.g. a zoom out that undoes a
            magnified target, is credited). A research setting: on the default synthetic
            shift it credits zoom-ins that lower the soft Dice loss of the average but cost TTA Dice
            (``benchmarks/README.md``, "A zoom shift"). ``"with-identity-hard"``: the same pair scored by the
            hard Dice of its argmax, the segmentation the TTA outputs (not differentiable, and need not be: both
            estimators use the scores as values), so that an average of logits cannot gain by softening alone.
            ``"ensemble"``: the op scored by what it adds to the TTA the policy stands for now — the ``tta_z`` ops
            of highest probability (with ``tta_identity_weight``: the identity at that weight and the top
            ``tta_z - 1`` others), their mapped-back logits averaged with the TTA's weights into ``l_E``: copy k's
            score is the untouched copy's loss plus ``g . (l_k - l_0)``, ``g`` the gradient of the soft Dice loss
            of ``softmax(l_E)`` at ``l_E``, so that a score difference is the first-order change of the
            ensemble's loss when weight moves from the identity to op k (members and outsiders alike; each
            update also predicts the ensemble's ops). A research setting.
        tta_z, tta_identity_weight: the TTA the ``"ensemble"`` score rates ops for (the bundles' ``tea_z`` and
            ``tea_identity_weight``; see :meth:`jcsaug.inference.TEAInferer.from_policy`); unused by the others.
        inferer: how each copy is predicted: ``None``, one pass of the network over the patch; a MONAI inferer
            (``inferer(batch, model)``), e.g. the ``SlidingWindowInferer`` the test predicts with, so that the ops
            are scored on the predictions the TTA will average when the patch is larger than the training patches
            (a whole volume). A research setting (the synthetic bundle's ``tea_sliding_window``): on a zoom shift's
            final networks it rates the zoom-outs as the test does, but in joint runs it did not raise the TTA's
            Dice (``benchmarks/README.md``).
        step_rule: how the op effects move the logits, a name of :data:`~jcsaug.engine.base.POLICY_STEPS`
            (paired only; see :class:`~jcsaug.engine.base.PolicyUpdater`).
        mask_out_of_view: score each copy on the voxels its op kept in the field of view only
            (:func:`jcsaug.ops.tea.in_view_masks`), as the reference code does: a scale-up or a small rotation is
            then judged on the centre it kept, not on the border padding its inverse fills the rest with (on a
            64³ patch, 67 % of the voxels of ``scale_up_0.45``, 14 % of a 25-degree rotation's). ``False``
            (the default) scores every voxel.

    Volume statistics: when the validation batches carry their volumes' intensity statistics
    (:class:`jcsaug.data.VolumeStatsd` in the validation pipeline, before the crop), the copies' intensity ops read
    them instead of the patch's own (gamma's range, contrast's mean, sharpening's clip), so an op bends a patch as it
    bends the whole volume the TTA applies it to at test time; without them, each patch's own.

    Example: learn a TEA policy for a frozen network, one update per iteration::

        >>> import torch
        >>> from ignite.engine import Engine
        >>> from jcsaug.policy import make_tea_policy
        >>> net = torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv3d(4, 2, 1))
        >>> label = torch.zeros(2, 1, 16, 16, 16)
        >>> label[:, :, 5:11, 5:11, 5:11] = 1  # foreground at the patch centre
        >>> validation = [{"image": torch.randn(2, 1, 16, 16, 16) + label, "label": label}]
        >>> policy = make_tea_policy("nnunet")
        >>> updater = TEAPolicyUpdater(policy, net, validation, lr=0.01, num_copies=4)
        >>> engine = Engine(lambda engine, batch: None)  # no model step
        >>> updater.attach(engine)
        >>> _ = engine.run(range(3), max_epochs=1)
        >>> updater.updates, bool((policy.logits != make_tea_policy("nnunet").logits).any())
        (3, True)
    """

    seed_offset = 7919  # the TEA's op draws are independent of a TRA updater's Gumbel noise of the same seed

    def __init__(
        self,
        policy: CategoricalPolicy,
        model: nn.Module,
        val_loader: Iterable | None,
        lr: float = 5e-5,
        update_every: int = 1,
        num_copies: int = 10,
        ops: Sequence | None = None,
        image_key: str = "image",
        label_key: str = "label",
        prepare_batch: PrepareBatch | None = None,
        max_batches: int = 4,
        poly_power: float = 0.9,
        seed: int = 0,
        mask_undrawn: bool = True,
        estimator: str = "gumbel",
        logit_budget: float | None = None,
        patches: int = 1,
        background_patches: int = 0,
        effect_smoothing: float = 0.1,
        op_score: str = "alone",
        tta_z: int = 8,
        tta_identity_weight: IdentityWeight = None,
        inferer: Inferer | None = None,
        step_rule: str = "adam",
        mask_out_of_view: bool = False,
        planned_epochs: int | None = None,
    ) -> None:
        super().__init__(
            policy,
            model,
            lr,
            update_every,
            poly_power,
            seed,
            name="TEA",
            logit_budget=logit_budget,
            frequency_scaling=estimator == "paired",
            step_rule=step_rule,
            planned_epochs=planned_epochs,
        )
        self.mask_undrawn = mask_undrawn
        TEA_ESTIMATORS.key(estimator)  # an unknown name: an error listing the valid ones
        if int(patches) < 1:
            raise ValueError(f"patches must be >= 1, got {patches}")
        self.estimator = estimator
        self.patches = int(patches)
        self.op_score = TEA_OP_SCORES.key(op_score)
        self.background_patches = int(background_patches)
        if self.background_patches < 0:
            raise ValueError(f"background_patches must be >= 0, got {background_patches}")
        if self.background_patches and self.op_score == "ensemble":
            raise ValueError("background_patches needs an op_score other than 'ensemble' (it scores one patch)")
        self._settings.update(estimator=estimator, num_copies=int(num_copies), patches=self.patches)
        self.tta_z = int(tta_z)
        self.tta_identity_weight = check_identity_weight(tta_identity_weight)
        if self.op_score == "ensemble":
            self._settings.update(tta_z=self.tta_z, tta_identity_weight=self.tta_identity_weight)
        self.mask_out_of_view = bool(mask_out_of_view)
        self.inferer = inferer
        # how the copies are scored (checkpoints saved before these were recorded ran with the defaults, which a
        # resume check assumes for them: resume.UPDATER_SETTINGS_BEFORE_SAVED)
        self._settings.update(
            background_patches=self.background_patches, op_score=self.op_score,
            mask_out_of_view=self.mask_out_of_view, inferer=None if inferer is None else type(inferer).__name__,
        )  # fmt: skip
        self.effects = self._paired_effects(estimator, effect_smoothing)
        if ops is None:
            from jcsaug.ops.tea import TEA_OPS

            ops = TEA_OPS
        if policy.num_series != 1 or policy.series_sizes[0] != len(ops):
            raise ValueError(f"TEA policy must have one series of {len(ops)} ops, got sizes {policy.series_sizes}")
        if num_copies < 1:
            raise ValueError(f"num_copies (Z) must be >= 1, got {num_copies}")
        if estimator == "paired" and num_copies > len(ops) - 1:
            raise ValueError(f"num_copies (Z) must be <= {len(ops) - 1} (the non-identity ops) for 'paired'")
        self.ops = ops
        if self.op_score == "ensemble":  # bad values: an error now, naming the setting
            tta_selection(policy.logits.detach()[0], self.tta_z, self.tta_identity_weight, name="tta_z")
        self.num_copies = int(num_copies)
        self.val_stream = ValidationStream(val_loader)
        self.image_key = image_key
        self.prepare_batch = prepare_batch or make_prepare_batch(image_key, label_key)
        self.max_batches = int(max_batches)
        self.last_dice: dict[str, float] = {}

    def _foreground_patches(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor, VolumeStats | None, list]]:
        """Up to ``count`` foreground-centred validation patches (else patches with some foreground), each as
        ``(image, label, stats, background)``: its volume's intensity statistics (``[1]`` each) when the batch
        carries them, and up to ``background_patches`` background-centred patches ``(image, label, stats)`` to score
        with it (as many as the searched batches held)."""
        wanted = count * self.background_patches
        found, fallback, background = [], [], []
        for _ in range(self.max_batches * (1 + self.background_patches)):
            batch: Mapping | None = self.val_stream.next()
            if batch is None:
                raise SkipUpdate("the validation loader is empty")
            image, label = self.prepare_batch(batch, self.device)
            stats = batch_volume_stats(batch, self.image_key)
            for i in range(image.shape[0]):
                patch = (image[i], label[i], None if stats is None else {k: v[i : i + 1] for k, v in stats.items()})
                if centre_class(label[i].cpu()) != 0:
                    if len(found) < count:
                        found.append(patch)
                elif len(background) < wanted:
                    background.append(patch)
                elif bool((label[i] != 0).any()):
                    fallback.append(patch)
                if len(found) == count and len(background) == wanted:
                    return self._with_background(found, background)
        found += fallback[: count - len(found)]
        if not found:
            raise SkipUpdate("no validation patch with foreground")
        return self._with_background(found, background)

    def _with_background(self, found: list, background: list) -> list:
        k = self.background_patches
        return [(*patch, background[j * k : (j + 1) * k]) for j, patch in enumerate(found)]

    def _mapped_back_dice(
        self,
        image: torch.Tensor,
        label: torch.Tensor,
        ops: Sequence,
        stats: VolumeStats | None = None,
        background: Sequence[tuple] = (),
    ) -> torch.Tensor:
        """Soft Dice losses ``[1 + len(ops)]`` of the untouched patch and of each op's mapped-back prediction: its
        softmax probabilities mapped back (``op_score="alone"``), its logits mapped back and then the softmax
        (``"alone-logits"``, as :class:`jcsaug.inference.TEAInferer` forms it), or the average of its mapped-back
        logits and the untouched copy's (``"with-identity"``); with ``"alone-hard"`` / ``"with-identity-hard"`` one
        minus the hard Dice of the argmax of the op's mapped-back logits / of that average (the untouched copy's own
        logits for the untouched one). With ``mask_out_of_view``, each over the voxels its op kept in view (a pair: its
        op's). ``stats``: the patch's volume's intensity statistics (``[1]`` each) for the copies' intensity ops.
        ``background``: patches ``(image, label, stats)`` of the patch's shape that get the same ops, each copy's
        score then one Dice pooled over the patch and these."""
        if self.op_score == "ensemble":
            return self._ensemble_scores(image, label, ops, stats)
        logits = self.op_score != "alone"
        background = [patch for patch in background if patch[0].shape == image.shape]  # (volumes smaller than a patch)
        patches = [(image, label, stats), *background]
        mapped = [torch.stack(self._mapped_back_predictions(x, ops, logits, s)) for x, _, s in patches]
        masks = self._in_view(mapped[0], ops)  # the same ops on patches of one shape: the same masks for each
        # one Dice pooled over the patches: side by side along the last axis, the voxel sums of a Dice run over all
        mapped, label = torch.cat(mapped, dim=-1), torch.cat([y for _, y, _ in patches], dim=-1)
        masks = None if masks is None else torch.cat([masks] * len(patches), dim=-1)
        if self.op_score.startswith("with-identity"):  # the TTA's ensemble of the identity and the op: logits averaged
            mapped = torch.cat([mapped[:1], (mapped[:1] + mapped[1:]) / 2])
        labels = label.unsqueeze(0).expand(len(mapped), *label.shape)
        if self.op_score.endswith("-hard"):
            return hard_dice_loss(mapped, labels, masks).double().cpu()
        probs = torch.softmax(mapped, dim=1) if logits else mapped
        return soft_dice_loss(probs, labels, masks).double().cpu()

    def _in_view(self, prediction: torch.Tensor, ops: Sequence) -> torch.Tensor | None:
        """``[1 + len(ops), 1, X, Y, Z]`` the voxels each copy is scored on (the untouched copy's: all), or ``None``
        (every voxel) unless ``mask_out_of_view``; on the grid of the ``prediction`` (``[..., X, Y, Z]``), which is
        smaller than the patch for a network without padding such as DeepMedic: in view is then where the inverse
        reads the op's prediction, the central part of its copy that the network segments."""
        if not self.mask_out_of_view:
            return None
        masks = in_view_masks([self.ops[0], *ops], prediction.shape[-3:], prediction.device)
        return torch.stack(masks)

    def _mapped_back_predictions(
        self, image: torch.Tensor, ops: Sequence, logits: bool, stats: VolumeStats | None = None
    ) -> list[torch.Tensor]:
        """The network's predictions (softmax, or ``logits``) of the untouched patch and of each op's copy mapped
        back by its inverse, ``[C, ...]`` each; the network in eval mode without gradients, its mode restored."""
        was_training = self.model.training
        self.model.eval()
        if stats is not None:  # the patch's volume's statistics, one row per copy
            stats = {k: v.expand(len(ops)) for k, v in stats.items()}
        try:
            with torch.no_grad():
                copies = apply_tea_ops(ops, image.expand(len(ops), *image.shape), "image", stats)  # one batched call
                preds = predict_by_shape(self.model, [image, *copies], logits=logits, inferer=self.inferer)
        finally:
            self.model.train(was_training)
        return [preds[0], *apply_tea_ops_by_shape(ops, preds[1:], "invert")]

    def _ensemble_scores(
        self, image: torch.Tensor, label: torch.Tensor, ops: Sequence, stats: VolumeStats | None = None
    ) -> torch.Tensor:
        """``op_score="ensemble"``: ``[1 + len(ops)]`` the untouched copy's soft Dice loss and, per op, that loss
        plus ``g . (l_op - l_identity)`` (see the class docstring); every op is predicted once."""
        indices, weights = tta_selection(self.policy.logits.detach()[0], self.tta_z, self.tta_identity_weight, "tta_z")
        members = [self.ops[i] for i in indices]
        identity = self.ops[0]
        # the ops to predict, each once (by identity of the op object; the identity is the untouched copy)
        predicted = list({id(op): op for op in [*ops, *members] if op is not identity}.values())
        mapped = [m.double() for m in self._mapped_back_predictions(image, predicted, True, stats)]
        logits_of = {id(op): m for op, m in zip([identity, *predicted], mapped)}

        ensemble = sum(w * logits_of[id(op)] for op, w in zip(members, weights.tolist())).detach().requires_grad_()
        with torch.enable_grad():
            loss = soft_dice_loss(torch.softmax(ensemble, dim=0)[None], label[None])[0]
            (g,) = torch.autograd.grad(loss, ensemble)
        untouched = soft_dice_loss(torch.softmax(mapped[0], dim=0)[None], label[None])[0]
        masks = self._in_view(mapped[0], ops)  # an op's change counted where it kept the view
        changes = [
            (g * (logits_of[id(op)] - mapped[0]) * (1.0 if masks is None else masks[1 + k])).sum()
            for k, op in enumerate(ops)
        ]
        return torch.stack([untouched, *(untouched + c for c in changes)]).detach().double().cpu()

    def _paired_update(self, engine: Engine) -> None:
        measured_ops, effects, untouched, augmented = [], [], [], []
        for image, label, stats, background in self._foreground_patches(self.patches):
            # Z distinct non-identity ops, uniformly: every op is measured whatever its probability
            drawn = torch.randperm(len(self.ops) - 1, generator=self.generator)[: self.num_copies] + 1
            dice = self._mapped_back_dice(image, label, [self.ops[int(k)] for k in drawn], stats, background)
            if not torch.isfinite(dice).all():
                raise SkipUpdate("non-finite TEA Dice")
            measured_ops.append(drawn)
            effects.append(dice[1:] - dice[0])
            untouched.append(float(dice[0]))
            augmented.append(float(dice[1:].mean()))
        self.last_dice = {
            "untouched": sum(untouched) / len(untouched),
            "augmented_mean": sum(augmented) / len(augmented),
        }
        ops = torch.cat(measured_ops)
        zeros = torch.zeros_like(ops)
        sums, counts = self.effects.accumulate(zeros, zeros, ops, torch.cat(effects))
        grad, mask = self.effects.gradient(sums, counts)
        self._apply_gradient(engine, grad.to(self.policy.logits.dtype), mask)

    def update(self, engine: Engine) -> None:
        if self.estimator == "paired":
            self._paired_update(engine)
            return
        patches = self._foreground_patches(self.patches)
        z = self.num_copies
        choices, weights = self.policy.gumbel_sample(torch.zeros(len(patches) * z, dtype=torch.long), self.generator)
        h, untouched, augmented = [], [], []
        for p, (image, label, stats, background) in enumerate(patches):  # each patch with its own Z copies
            ops = [self.ops[int(k)] for k in choices[p * z : (p + 1) * z, 0]]
            dice = self._mapped_back_dice(image, label, ops, stats, background)
            if not torch.isfinite(dice).all():
                raise SkipUpdate("non-finite TEA Dice")
            untouched.append(float(dice[0]))
            augmented.append(float(dice[1:].mean()))
            # L_p = sum_k w_k D_k / sum_k w_k at w = 1: dL_p/dw_k = (D_k - mean D) / Z (centred on the patch's own
            # copies, so that an easy and a hard patch are compared op against op, not patch against patch)
            w = torch.ones(z, dtype=torch.float64, requires_grad=True)
            (grad,) = torch.autograd.grad((w * dice[1:]).sum() / w.sum(), w)
            h.append(grad)
        self.last_dice = {
            "untouched": sum(untouched) / len(untouched),
            "augmented_mean": sum(augmented) / len(augmented),
        }
        # L = the mean of the patches' L_p; each op's gradient divided by how often it was drawn over all patches
        h_all = torch.cat(h) / len(patches)
        drawn = choices[:, 0]
        counts = (drawn[:, None] == drawn[None, :]).sum(1).double()
        drawn = self.policy.drawn_mask(choices) if self.mask_undrawn else None
        self.step(engine, ((h_all / counts).to(weights.dtype) * weights[:, 0]).sum(), drawn)
