"""Test-time augmentation inferers (SPEC §5): learned top-z TEA, nnU-Net-style mirroring, none, and the learned TEA
blended with mirroring.

One factory builds them by method name, :func:`make_tta_inferer` (``none``, ``heuristic``, ``learned``,
``learned+mirror``; more with :func:`register_tta_inferer`); the method names are those of ``metrics.json``,
``per_case.csv`` and ``jcsaug report``.

They are MONAI ``Inferer`` s wrapping any base inferer (``SimpleInferer``, ``SlidingWindowInferer``):
each op transforms the input, the base inferer predicts, the op maps the prediction back, and the
predictions are averaged with the op weights. The ops transform and map back all copies in batched calls
on the input's device (:func:`jcsaug.ops.tea.apply_tea_ops`), and copies whose transformed shapes agree go
through the base inferer together as one batch.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from monai.inferers import Inferer, SimpleInferer

from jcsaug.ops.tea import TEA_OPS, TEAOp, apply_tea_ops
from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.policy.presets import TEA_FLIP_IDS
from jcsaug.registry import Registry

Average = Literal["logits", "probabilities"]


#: the ``identity_weight`` that gives the identity and the ``z - 1`` other ops of highest probability 1/z each
EQUAL_WEIGHTS = "equal"

IdentityWeight = float | Literal["equal"] | None


def check_identity_weight(value: object) -> IdentityWeight:
    """``value`` as a TTA's ``identity_weight``: ``None``, :data:`EQUAL_WEIGHTS` or a real number in (0, 1)
    (returned as a float); anything else, a numeric string or a bool included, is a ``ValueError`` naming it.
    Preflight checks a bundle's ``tea_identity_weight`` with this same function."""
    if value is None:
        return None
    if value == EQUAL_WEIGHTS:
        return EQUAL_WEIGHTS
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (real and 0.0 < float(value) < 1.0):  # (NaN fails the comparison)
        raise ValueError(f"identity_weight must be a number in (0, 1), {EQUAL_WEIGHTS!r} or None, got {value!r}")
    return float(value)


def tta_selection(
    logits: torch.Tensor, z: int = 8, identity_weight: IdentityWeight = None, name: str = "z"
) -> tuple[list[int], torch.Tensor]:
    """The ops a learned TTA uses and their weights, from a TEA policy's ``[N]`` logits (op 0: the identity):
    ``(indices, float64 weights summing to 1)``.

    The ``z`` ops of highest probability weighted by the softmax of their logits (the paper's); with an
    ``identity_weight`` w in (0, 1), the identity at w and the ``z - 1`` other ops of highest probability sharing
    1 - w by the softmax of their logits (see :meth:`TEAInferer.from_policy`); with ``"equal"``
    (:data:`EQUAL_WEIGHTS`), the identity and the ``z - 1`` other ops of highest probability at 1/z each (research,
    benchmarks/README.md: the probabilities choose the ops, not their weights). A ``z`` outside ``[1, N]`` is an
    error naming it as ``name`` (the caller's setting)."""
    if not 1 <= z <= len(logits):
        raise ValueError(f"{name} must be in [1, {len(logits)}], got {z}")
    identity_weight = check_identity_weight(identity_weight)
    if identity_weight is None:
        top = torch.topk(logits, z).indices
        return [int(i) for i in top], torch.softmax(logits[top].double(), 0)
    if z < 2:
        raise ValueError(f"{name} must be >= 2 with an identity_weight (the identity and at least one op), got {z}")
    top = torch.topk(logits[1:], z - 1).indices + 1  # op 0 is the identity
    if identity_weight == EQUAL_WEIGHTS:
        return [0, *(int(i) for i in top)], torch.full((z,), 1.0 / z, dtype=torch.float64)
    others = (1.0 - identity_weight) * torch.softmax(logits[top].double(), 0)
    return [0, *(int(i) for i in top)], torch.cat([torch.tensor([identity_weight], dtype=torch.float64), others])


def _normalised_weights(weights: Sequence[float] | torch.Tensor | None, n: int) -> list[float]:
    """``n`` finite non-negative weights (default equal) scaled to sum 1; anything else is refused."""
    w = torch.ones(n, dtype=torch.float64) if weights is None else torch.as_tensor(weights).double()
    if w.shape != (n,) or not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"expected {n} finite non-negative weights, got {w.tolist()}")
    return (w / w.sum()).tolist()


class TEAInferer(Inferer):
    """Average the predictions of ``ops``-transformed copies, mapped back, with ``weights``.

    Args:
        ops: TEA ops (objects with ``transform_image`` and ``invert``).
        weights: one non-negative weight per op (normalised to sum 1).
        base_inferer: the inferer run on each (batch of) transformed copies; default ``SimpleInferer``.
        average: ``"logits"`` averages the mapped-back network outputs (the reference code's choice);
            ``"probabilities"`` averages their softmax and returns its log (so ``softmax``/``argmax``
            downstream work on either).

    Example: a network that commutes with mirroring predicts the same with and without this TTA::

        >>> import torch
        >>> from jcsaug.ops.tea import get_tea_op
        >>> net = torch.nn.Conv3d(1, 2, kernel_size=1)
        >>> inferer = TEAInferer([get_tea_op("identity"), get_tea_op("mirror_sagittal")], weights=[0.5, 0.5])
        >>> x = torch.randn(1, 1, 8, 8, 8)
        >>> torch.allclose(inferer(x, net), net(x), atol=1e-6)
        True
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
        normalised = _normalised_weights(weights, len(ops))
        if average not in ("logits", "probabilities"):
            raise ValueError(f"average must be 'logits' or 'probabilities', got {average!r}")
        self.ops = list(ops)
        self.weights = normalised
        self.base_inferer = base_inferer or SimpleInferer()
        self.average = average

    @classmethod
    def from_policy(
        cls,
        policy: CategoricalPolicy,
        z: int = 8,
        base_inferer: Inferer | None = None,
        average: Average = "logits",
        identity_weight: IdentityWeight = None,
    ) -> TEAInferer:
        """The ``z`` ops of highest probability, weighted by the softmax of their logits (the paper's).

        ``identity_weight`` (in (0, 1)): the identity at that weight plus the ``z - 1`` non-identity ops of highest
        probability sharing the rest by the softmax of their logits. With 1/2, the ensemble is the
        probability-weighted mixture of (identity, op) pairs, the ensemble a policy learned with a TEA op score of
        ``with-identity`` (:class:`jcsaug.engine.TEAPolicyUpdater`) scored its ops for: such a policy can put
        its weight on ops that help only beside the identity (a zoom that fails alone). ``"equal"``: the identity
        and the ``z - 1`` non-identity ops of highest probability, 1/z each (:func:`tta_selection`)."""
        if policy.num_series != 1 or policy.series_sizes[0] != len(TEA_OPS):
            raise ValueError(
                f"not a TEA policy: expected one series of {len(TEA_OPS)} ops, got sizes {list(policy.series_sizes)}"
            )
        indices, weights = tta_selection(policy.logits.detach()[0], z, identity_weight)
        return cls([TEA_OPS[i] for i in indices], weights, base_inferer, average)

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


def load_tea_policy(path: str | Path, missing_ok: bool = False) -> CategoricalPolicy | None:
    """The TEA policy of a ``policies.json`` or of a checkpoint holding a ``tea`` updater/policy state.

    ``missing_ok``: ``None`` instead of an error when the file does not exist or holds no TEA policy.
    """
    from jcsaug.policy.factory import make_tea_policy
    from jcsaug.policy.io import load_policies

    path = Path(path)
    if not path.exists():
        if missing_ok:
            return None
        raise FileNotFoundError(f"policy file {path} does not exist")
    if path.suffix == ".json":
        _, tea = load_policies(path)
        if tea is None and not missing_ok:
            raise ValueError(f"{path} holds no TEA policy")
        return tea
    from jcsaug.engine.checkpoints import read_checkpoint  # weights-only; names the refused global, if any

    state = read_checkpoint(path)
    for key in ("tea", "tea_updater", "tea_policy"):
        if key in state:
            entry = state[key]
            policy = make_tea_policy("uniform")
            policy.load_state_dict(entry["policy"] if "policy" in entry else entry)
            return policy
    if missing_ok:
        return None
    raise ValueError(f"checkpoint {path} holds no TEA policy (keys: {sorted(state)})")


@dataclass(frozen=True)
class TEAPolicyFile:
    """A ``policies.json`` (or checkpoint) whose TEA policy a learned TTA follows as the file changes
    (:class:`PolicyFileTEAInferer`), and the TEA policy to use until the file exists: ``initial`` (e.g. a run's TEA
    policy before learning, :func:`jcsaug.engine.initial_tea_policy`); ``None``: no learned TTA until then.

    What ``evaluate.yaml`` gives its ``learned`` methods, so an evaluator built before a run writes its
    ``policies.json`` (MONAI FL's client, evaluated between training rounds) tests the TEA policy learned so far."""

    path: str | Path
    initial: CategoricalPolicy | None = None


TEAPolicyLike = CategoricalPolicy | str | Path | TEAPolicyFile | None


class BlendedTTAInferer(Inferer):
    """The weighted mean of several test-time inferers' class probabilities (the softmax of each one's output),
    returned as its log, so ``softmax``/``argmax`` downstream work as on the others.

    The method ``learned+mirror`` blends the learned TEA's top ``z`` ops and nnU-Net's 8 mirrorings 1:1, at the cost
    of both (``z`` + 8 copies). Beyond the paper: the learned TEA is fitted on the few validation volumes it
    scores its ops on, and mirroring fits nothing. Over 28 joint runs of eight synthetic shifts the blend was 0.7
    Dice above the learned TEA alone, on no shift below it; four new runs did not confirm it (+0.2 on average, one
    run 1.3 below, where the learned TEA carries a quarter turn that mirroring lacks), so no run uses it by default
    (``benchmarks/README.md``, section "The power below 1: where the joint's gain goes, and the learned TTA blended
    with mirroring").

    Args:
        members: the inferers (each returns logits or log-probabilities: its softmax is its class probabilities).
        weights: one non-negative weight per member (normalised to sum 1); default equal.

    Example: members that agree give their own prediction::

        >>> import torch
        >>> net = torch.nn.Conv3d(1, 2, kernel_size=1)
        >>> x = torch.randn(1, 1, 4, 4, 4)
        >>> blended = BlendedTTAInferer([NoTTAInferer(), NoTTAInferer()])(x, net)
        >>> torch.allclose(blended.softmax(1), net(x).softmax(1), atol=1e-6)
        True
    """

    def __init__(self, members: Sequence[Inferer], weights: Sequence[float] | None = None) -> None:
        super().__init__()
        if not members:
            raise ValueError("BlendedTTAInferer needs at least one member")
        self.members = list(members)
        self.weights = _normalised_weights(weights, len(members))

    def __call__(self, inputs: torch.Tensor, network: Callable, *args, **kwargs) -> torch.Tensor:
        return self.combine([member(inputs, network, *args, **kwargs) for member in self.members])

    def combine(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The blend of the members' outputs (one per member, in order), for a caller that has them already
        (:func:`jcsaug.evaluation.evaluate_cases` predicts each method once)."""
        if len(outputs) != len(self.members):
            raise ValueError(f"BlendedTTAInferer.combine: {len(outputs)} outputs for {len(self.members)} members")
        total = None
        for out, weight in zip(outputs, self.weights):
            probabilities = weight * torch.softmax(out.as_tensor() if hasattr(out, "as_tensor") else out, dim=1).float()
            total = probabilities if total is None else total + probabilities
        return torch.log(total.clamp_min(1e-8))


class _NeedsPolicy(ValueError):
    """A learned method without a TEA policy to learn from."""


class PolicyFileTEAInferer(TEAInferer):
    """The learned TTA (:meth:`TEAInferer.from_policy`) of the TEA policy a file holds when it predicts: the file is
    read again whenever it has changed (its size, modification time or inode: ``policies.json`` is replaced
    atomically) since it was last read, so an inferer built once follows a run that is still learning.

    Args:
        source: the ``policies.json`` or checkpoint, or a :class:`TEAPolicyFile` (its ``initial`` policy is used
            until the file exists).
        z, base_inferer, identity_weight, average: as :meth:`TEAInferer.from_policy`.

    A file that does not exist (and no ``initial`` policy) or that holds no TEA policy when the inferer is built
    is refused (``ValueError``, naming it); one that holds none when it is read again is an error naming it; one
    deleted after it was read keeps the policy last read.

    Example: the ops follow the file::

        >>> import tempfile
        >>> from jcsaug.policy import make_tea_policy
        >>> from jcsaug.policy.io import save_policies
        >>> path = Path(tempfile.mkdtemp()) / "policies.json"
        >>> policy = make_tea_policy("uniform")
        >>> with torch.no_grad():
        ...     policy.logits[0, 38] = 5.0  # mirror_sagittal
        >>> with warnings.catch_warnings(record=True) as said:
        ...     warnings.simplefilter("always")
        ...     inferer = PolicyFileTEAInferer(TEAPolicyFile(path, initial=policy), z=1)
        >>> "does not exist yet" in str(said[0].message)  # it says so, and uses the initial policy
        True
        >>> [op.name for op in inferer.ops]
        ['mirror_sagittal']
        >>> with torch.no_grad():
        ...     policy.logits[0, 3] = 9.0
        >>> _ = save_policies(path, tea=policy)  # the run writes what it has learned
        >>> inferer.refresh(), [op.name for op in inferer.ops]
        (True, ['scale_down_0.25'])
    """

    def __init__(
        self,
        source: TEAPolicyFile | str | Path,
        z: int = 8,
        base_inferer: Inferer | None = None,
        identity_weight: IdentityWeight = None,
        average: Average = "logits",
    ) -> None:
        source = source if isinstance(source, TEAPolicyFile) else TEAPolicyFile(source)
        self.path, self.z, self.identity_weight = Path(source.path), int(z), check_identity_weight(identity_weight)
        self._signature: tuple | None = None
        policy = self._read(missing_ok=True)
        if policy is None:
            if self._signature is not None:  # the file was read
                raise _NeedsPolicy(f"test-time augmentation 'learned' needs a TEA policy: {self.path} holds none")
            if source.initial is None:
                raise _NeedsPolicy(f"test-time augmentation 'learned' needs a TEA policy: {self.path} does not exist")
            warnings.warn(
                f"{self.path} does not exist yet: the learned TTA uses the initial TEA policy until it is written, "
                "then the file's",
                stacklevel=2,
            )
            policy = source.initial
        chosen = self._selection(policy)
        super().__init__(chosen.ops, chosen.weights, base_inferer, average)

    def _selection(self, policy: CategoricalPolicy) -> TEAInferer:
        """``policy``'s top ops and their weights, chosen as :meth:`TEAInferer.from_policy` chooses them."""
        return TEAInferer.from_policy(policy, self.z, identity_weight=self.identity_weight)

    def _file_signature(self) -> tuple | None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return None
        return stat.st_size, stat.st_mtime_ns, stat.st_ino

    def _read(self, missing_ok: bool = False) -> CategoricalPolicy | None:
        """The file's TEA policy (None if the file is not there), its signature remembered."""
        signature = self._file_signature()
        if signature is None:
            return None
        policy = load_tea_policy(self.path, missing_ok=missing_ok)
        self._signature = signature
        return policy

    def refresh(self) -> bool:
        """Read the file again if it changed since it was read (or was written since the inferer was built); True
        if the ops or their weights changed."""
        signature = self._file_signature()
        if signature is None or signature == self._signature:
            return False
        chosen = self._selection(self._read())
        changed = [op.id for op in chosen.ops] != [op.id for op in self.ops] or chosen.weights != self.weights
        self.ops, self.weights = chosen.ops, chosen.weights
        return changed

    def __call__(self, inputs: torch.Tensor, network: Callable, *args, **kwargs) -> torch.Tensor:
        self.refresh()
        return super().__call__(inputs, network, *args, **kwargs)


def _learned(
    base: Inferer | None, tea_policy: TEAPolicyLike, z: int, identity_weight: IdentityWeight = None
) -> TEAInferer:
    if tea_policy is None:
        raise _NeedsPolicy("test-time augmentation 'learned' needs a TEA policy, and none was given")
    if isinstance(tea_policy, (str, Path, TEAPolicyFile)):
        return PolicyFileTEAInferer(tea_policy, z, base, identity_weight)
    return TEAInferer.from_policy(tea_policy, z, base, identity_weight=identity_weight)


#: test-time method name -> factory ``(base_inferer, tea_policy, z, **options) -> Inferer`` (options: an
#: ``identity_weight``, when one is given); the method names of ``metrics.json``, ``per_case.csv`` and ``jcsaug report``
TTA_INFERERS: Registry[Callable[[Inferer | None, TEAPolicyLike, int], Inferer]] = Registry("test-time augmentation")
TTA_INFERERS.register("none", lambda base, tea_policy, z, **options: NoTTAInferer(base))
TTA_INFERERS.register("heuristic", lambda base, tea_policy, z, **options: MirrorTTAInferer(base))
TTA_INFERERS.register("learned", _learned)


def register_tta_blend(name: str, members: Sequence[str]) -> None:
    """Register ``name`` as the 1:1 :class:`BlendedTTAInferer` of the registered methods ``members``. Its factory
    carries them as ``members``, so :func:`make_tta_inferers` builds it from the same member inferers it returns,
    and a caller that predicts with every method (``evaluate_cases``) predicts each member once."""
    members = tuple(members)
    for member in members:
        get_tta_inferer(member)  # a clear error naming the unknown method, now rather than at the first build

    def factory(base: Inferer | None, tea_policy: TEAPolicyLike, z: int, **options) -> BlendedTTAInferer:
        return BlendedTTAInferer([get_tta_inferer(m)(base, tea_policy, z, **options) for m in members])

    factory.members = members
    TTA_INFERERS.register(name, factory)


#: ``register_tta_inferer(name, factory)`` with ``factory(base_inferer, tea_policy, z) -> Inferer``,
#: ``get_tta_inferer(name)``, ``list_tta_inferers()``
register_tta_inferer, get_tta_inferer, list_tta_inferers = TTA_INFERERS.register, TTA_INFERERS.get, TTA_INFERERS.names

register_tta_blend("learned+mirror", ["learned", "heuristic"])


def make_tta_inferer(
    method: str,
    base_inferer: Inferer | None = None,
    tea_policy: TEAPolicyLike = None,
    z: int = 8,
    identity_weight: IdentityWeight = None,
) -> Inferer:
    """The one factory of test-time inferers: ``none`` (plain), ``heuristic`` (nnU-Net's 8 mirrorings),
    ``learned`` (the top ``z`` ops of ``tea_policy``: a policy, or a ``policies.json``/checkpoint path or
    :class:`TEAPolicyFile`, followed as the file changes, :class:`PolicyFileTEAInferer`; with
    ``identity_weight``, the identity at that weight (or ``"equal"``: 1/z, as each other op) and the top ``z - 1``
    other ops, see :meth:`TEAInferer.from_policy`; passed to a registered factory only when given) or ``learned+mirror``
    (:class:`BlendedTTAInferer` of ``learned`` and ``heuristic``, 1:1).

    >>> from monai.inferers import SimpleInferer
    >>> from jcsaug.policy import make_tea_policy
    >>> policy = make_tea_policy([2.0, 3.0, 1.0] + [0.1] * 81)  # op 1 most probable, then 0, then 2
    >>> inferer = make_tta_inferer("learned", SimpleInferer(), tea_policy=policy, z=3)
    >>> [op.name for op in inferer.ops]
    ['scale_down_0.05', 'identity', 'scale_down_0.15']
    >>> type(make_tta_inferer("heuristic", SimpleInferer())).__name__  # nnU-Net's 8 mirrorings
    'MirrorTTAInferer'
    """
    identity_weight = check_identity_weight(identity_weight)
    options = {} if identity_weight is None else {"identity_weight": identity_weight}
    return get_tta_inferer(method)(base_inferer, tea_policy, int(z), **options)


def make_tta_inferers(
    methods: Sequence[str],
    base_inferer: Inferer | None = None,
    tea_policy: TEAPolicyLike = None,
    z: int = 8,
    skip_unavailable: bool = False,
    identity_weight: IdentityWeight = None,
) -> dict[str, Inferer]:
    """``{method: make_tta_inferer(method, ...)}``; ``skip_unavailable`` leaves out ``learned`` (and the blends of
    it) when there is no TEA policy (e.g. every registered method a finished run can be evaluated with);
    ``identity_weight``: see :func:`make_tta_inferer`. A blend (:func:`register_tta_blend`) is built from the very
    member inferers returned beside it, so :meth:`BlendedTTAInferer.combine` can reuse their outputs."""
    built: dict[str, Inferer] = {}

    def build(method: str) -> Inferer:
        if method not in built:
            members = getattr(get_tta_inferer(method), "members", None)  # a blend's (register_tta_blend)
            if members:
                built[method] = BlendedTTAInferer([build(member) for member in members])
            else:
                built[method] = make_tta_inferer(method, base_inferer, tea_policy, z, identity_weight)
        return built[method]

    inferers = {}
    for method in methods:
        try:
            inferers[method] = build(method)
        except _NeedsPolicy:
            if not skip_unavailable:
                raise
    return inferers
