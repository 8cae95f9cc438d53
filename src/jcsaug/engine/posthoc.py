"""Post-hoc learned TEA (the paper's "Learned TEA" baseline): learn a TEA policy on a frozen model."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from ignite.engine import Engine
from ignite.handlers import ProgressBar
from monai.inferers import Inferer
from torch import nn

from jcsaug.engine.tea_updater import TEAPolicyUpdater
from jcsaug.inference.tta import IdentityWeight
from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.policy.factory import make_tea_policy


def learn_tea_posthoc(
    network: nn.Module,
    val_loader: Iterable,
    iterations: int = 100,
    lr: float = 5e-3,
    num_copies: int = 10,
    policy: CategoricalPolicy | None = None,
    seed: int = 0,
    progress: bool = True,
    estimator: str = "gumbel",
    op_score: str = "alone",
    tta_z: int = 8,
    tta_identity_weight: IdentityWeight = None,
    inferer: Inferer | None = None,
    mask_out_of_view: bool = False,
    background_patches: int = 0,
) -> CategoricalPolicy:
    """Learn the TEA policy from the validation set with the network frozen (no model update).

    Runs an Ignite engine whose only work is the :class:`TEAPolicyUpdater` (one update per iteration);
    the reference code's post-hoc run uses lr 5e-3 for 10 epochs. ``estimator``, ``op_score``, ``tta_z``,
    ``tta_identity_weight``, ``inferer``, ``mask_out_of_view`` and ``background_patches`` are the
    :class:`TEAPolicyUpdater`'s. Returns the learned policy.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    policy = policy or make_tea_policy("nnunet")
    # tensors only: a module's extra state (DeepMedic's subsampling) is not one
    frozen = {n: t.detach().clone() for n, t in network.state_dict().items() if isinstance(t, torch.Tensor)}
    engine = Engine(lambda engine, batch: None)  # the model is never updated
    updater = TEAPolicyUpdater(
        policy, network, val_loader, lr=lr, num_copies=num_copies, seed=seed, estimator=estimator, op_score=op_score,
        tta_z=tta_z, tta_identity_weight=tta_identity_weight, inferer=inferer, mask_out_of_view=mask_out_of_view,
        background_patches=background_patches,
    )  # fmt: skip
    updater.sync_ranks = False  # may run on one rank only (a rank-0 evaluation): no collective all-reduce
    updater.attach(engine)
    if progress:
        ProgressBar(desc="post-hoc TEA", persist=True).attach(engine)
    engine.run(range(iterations), max_epochs=1)
    changed = [n for n, t in network.state_dict().items() if n in frozen and not torch.equal(t, frozen[n])]
    if changed:  # pragma: no cover - a guard, the updater never steps the network
        raise RuntimeError(f"post-hoc TEA changed the frozen network: {changed[:3]}")
    return policy
