"""Test-time augmentation inferers (SPEC §5): learned top-z TEA, nnU-Net-style mirroring, none.

They are MONAI ``Inferer`` s wrapping any base inferer (``SimpleInferer``, ``SlidingWindowInferer``):
each op transforms the input, the base inferer predicts, the op maps the prediction back, and the
predictions are averaged with the op weights. The ops transform and map back all copies in batched calls
on the input's device (:func:`jcsaug.ops.tea.apply_tea_ops`), and copies whose transformed shapes agree go
through the base inferer together as one batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
from monai.inferers import Inferer, SimpleInferer

from jcsaug.ops.tea import TEA_OPS, TEAOp, apply_tea_ops
from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.policy.presets import TEA_FLIP_IDS

Average = Literal["logits", "probabilities"]


class TEAInferer(Inferer):
    """Average the predictions of ``ops``-transformed copies, mapped back, with ``weights``.

    Args:
        ops: TEA ops (objects with ``transform_image`` and ``invert``).
        weights: one non-negative weight per op (normalised to sum 1).
        base_inferer: the inferer run on each (batch of) transformed copies; default ``SimpleInferer``.
        average: ``"logits"`` averages the mapped-back network outputs (the reference code's choice);
            ``"probabilities"`` averages their softmax and returns its log (so ``softmax``/``argmax``
            downstream work on either).
    """

    def __init__(
        self,
        ops: Sequence[TEAOp],
        weights: Sequence[float] | torch.Tensor | None = None,
        base_inferer: Inferer | None = None,
        average: Average = "logits",
    ) -> None:
        super().__init__()
        if not ops:
            raise ValueError("TEAInferer needs at least one op")
        w = torch.ones(len(ops), dtype=torch.float64) if weights is None else torch.as_tensor(weights).double()
        if w.shape != (len(ops),) or not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"expected {len(ops)} finite non-negative weights, got {w.tolist()}")
        if average not in ("logits", "probabilities"):
            raise ValueError(f"average must be 'logits' or 'probabilities', got {average!r}")
        self.ops = list(ops)
        self.weights = (w / w.sum()).tolist()
        self.base_inferer = base_inferer or SimpleInferer()
        self.average = average

    @classmethod
    def from_policy(
        cls, policy: CategoricalPolicy, z: int = 8, base_inferer: Inferer | None = None, average: Average = "logits"
    ) -> TEAInferer:
        """The ``z`` ops of highest probability, weighted by the softmax of their logits."""
        if policy.num_series != 1 or policy.series_sizes[0] != len(TEA_OPS):
            raise ValueError(
                f"not a TEA policy: expected one series of {len(TEA_OPS)} ops, got sizes {list(policy.series_sizes)}"
            )
        if not 1 <= z <= len(TEA_OPS):
            raise ValueError(f"z must be in [1, {len(TEA_OPS)}], got {z}")
        logits = policy.logits.detach()[0]
        top = torch.topk(logits, z).indices
        return cls([TEA_OPS[int(i)] for i in top], torch.softmax(logits[top].double(), 0), base_inferer, average)

    @classmethod
    def from_file(
        cls, path: str | Path, z: int = 8, base_inferer: Inferer | None = None, average: Average = "logits"
    ) -> TEAInferer:
        """Load the TEA policy from a ``policies.json`` or a checkpoint (``.pt``) and keep its top ``z`` ops."""
        return cls.from_policy(load_tea_policy(path), z, base_inferer, average)

    def _predict(self, x: torch.Tensor, network: Callable, *args, **kwargs) -> torch.Tensor:
        out = self.base_inferer(x, network, *args, **kwargs)
        if isinstance(out, (list, tuple)):
            out = out[0]
        return out.as_tensor() if hasattr(out, "as_tensor") else out

    def __call__(self, inputs: torch.Tensor, network: Callable, *args, **kwargs) -> torch.Tensor:
        image = inputs.as_tensor() if hasattr(inputs, "as_tensor") else inputs
        batch = image.shape[0]
        # every image of the batch under every op, transformed in one batched call on the input's device
        rows_ops = [op for op in self.ops for _ in range(batch)]
        rows = image.repeat(len(self.ops), *([1] * (image.ndim - 1)))
        transformed = apply_tea_ops(rows_ops, rows, "image")
        groups: dict[tuple, list[int]] = {}
        for i in range(len(self.ops)):
            groups.setdefault(tuple(transformed[i * batch].shape), []).append(i)
        total = None
        for members in groups.values():
            pred = self._predict(
                torch.cat([torch.stack(transformed[i * batch : (i + 1) * batch]) for i in members]),
                network, *args, **kwargs,
            )  # fmt: skip
            ops = [self.ops[i] for i in members for _ in range(batch)]
            mapped = torch.stack(apply_tea_ops(ops, pred, "invert")).float()
            if self.average == "probabilities":
                mapped = torch.softmax(mapped, dim=1)
            weights = torch.tensor([self.weights[i] for i in members], dtype=mapped.dtype, device=mapped.device)
            part = (mapped.view(len(members), batch, *mapped.shape[1:]) * weights.view(-1, *[1] * mapped.ndim)).sum(0)
            total = part if total is None else total + part
        return torch.log(total.clamp_min(1e-8)) if self.average == "probabilities" else total


class MirrorTTAInferer(TEAInferer):
    """nnU-Net's test-time mirroring: the 8 flip combinations in 3D, averaged probabilities."""

    def __init__(self, base_inferer: Inferer | None = None) -> None:
        super().__init__([TEA_OPS[i] for i in TEA_FLIP_IDS], None, base_inferer, average="probabilities")


class NoTTAInferer(TEAInferer):
    """Plain inference through the same interface (the identity op only)."""

    def __init__(self, base_inferer: Inferer | None = None) -> None:
        super().__init__([TEA_OPS[0]], None, base_inferer)


def load_tea_policy(path: str | Path) -> CategoricalPolicy:
    """The TEA policy of a ``policies.json`` or of a checkpoint holding a ``tea`` updater/policy state."""
    from jcsaug.policy.factory import make_tea_policy
    from jcsaug.policy.io import load_policies

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"policy file {path} does not exist")
    if path.suffix == ".json":
        _, tea = load_policies(path)
        if tea is None:
            raise ValueError(f"{path} holds no TEA policy")
        return tea
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises many types for a bad file
        raise ValueError(f"cannot read checkpoint {path}: {err}") from None
    for key in ("tea", "tea_updater", "tea_policy"):
        if key in state:
            entry = state[key]
            policy = make_tea_policy("uniform")
            policy.load_state_dict(entry["policy"] if "policy" in entry else entry)
            return policy
    raise ValueError(f"checkpoint {path} holds no TEA policy (keys: {sorted(state)})")


def evaluation_inferers(policies_path: str | Path, base_inferer: Inferer | None = None, z: int = 8) -> dict:
    """No TTA, nnU-Net mirroring, and (if the run's ``policies.json`` holds one) the learned TEA policy."""
    inferers: dict[str, TEAInferer] = {"none": NoTTAInferer(base_inferer), "heuristic": MirrorTTAInferer(base_inferer)}
    from jcsaug.policy.io import load_policies

    _, tea = load_policies(policies_path)
    if tea is not None:
        inferers["learned"] = TEAInferer.from_policy(tea, z, base_inferer)
    return inferers


#: name -> factory ``(base_inferer, policies_path, z) -> inferer`` of the bundles' ``tea_inference`` switch
TTA_INFERERS: dict[str, Callable[[Inferer | None, str | Path, int], TEAInferer]] = {
    "none": lambda base, policies_path, z: NoTTAInferer(base),
    "heuristic": lambda base, policies_path, z: MirrorTTAInferer(base),
    "learned": lambda base, policies_path, z: TEAInferer.from_file(policies_path, z, base),
}


def tta_inferer(name: str, base_inferer: Inferer | None, policies_path: str | Path, z: int = 8) -> TEAInferer:
    """The TTA inferer called ``name`` (``none``, ``heuristic`` mirroring, ``learned`` from ``policies_path``)."""
    if name not in TTA_INFERERS:
        raise KeyError(f"unknown test-time augmentation {name!r}; choose one of {sorted(TTA_INFERERS)}")
    return TTA_INFERERS[name](base_inferer, policies_path, z)
