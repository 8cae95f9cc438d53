"""What the TRA and TEA policy updaters share: the policy optimiser, its poly schedule, the validation
stream, batch preparation, skip-with-one-warning, logging of changes and checkpointable state."""

from __future__ import annotations

import logging
import math
import warnings
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from monai.data import list_data_collate
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from jcsaug.engine.optim import MaskedAdam
from jcsaug.engine.paired import OpEffects
from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.registry import Registry

logger = logging.getLogger("jcsaug.engine")


@dataclass(frozen=True)
class StepRule:
    """How a policy updater turns its gradient into logit steps (an entry of :data:`POLICY_STEPS`).

    Attributes:
        name: the rule's name (``step_rule`` of :class:`PolicyUpdater`, the bundles' ``tra_step``).
        description: one line for listings.
        natural: step on the natural gradient ``D_m - b`` of the paired estimator's op effects instead of the
            softmax gradient ``pi_m (D_m - b)`` (:class:`~jcsaug.engine.paired.OpEffects`); paired estimators only.
        second_moment: whose Adam second moment scales a logit's step: ``"entry"`` (its own), ``"group"`` (one per
            class group, :class:`~jcsaug.engine.optim.MaskedAdam` ``second_moment="row"``) or ``"series"`` (one per
            class group and series: ``row_blocks`` at the policy's series offsets).
        beta2: the decay of that second moment (Adam's 0.999 averages it over a whole run of a few hundred updates;
            a smaller one follows the effects measured lately).
        convexity_correction: each step also subtracts half the square of its measured part, so that noisy effects
            of zero mean leave the ops' probabilities unchanged in expectation
            (:class:`~jcsaug.engine.optim.MaskedAdam`'s ``convexity_correction``).
    """

    name: str
    description: str
    natural: bool = False
    second_moment: str = "entry"
    beta2: float = 0.999
    convexity_correction: bool = False

    def __post_init__(self) -> None:
        if self.second_moment not in ("entry", "group", "series"):
            raise ValueError(f"step rule {self.name!r}: second_moment must be 'entry', 'group' or 'series', "
                             f"got {self.second_moment!r}")  # fmt: skip
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"step rule {self.name!r}: beta2 must be in [0, 1), got {self.beta2}")

    def optimizer(self, policy: CategoricalPolicy, lr: float, frequency_scaling: bool) -> MaskedAdam:
        """The masked Adam that takes this rule's steps on ``policy``'s logits."""
        return MaskedAdam(
            policy.parameters(), lr=lr, betas=(0.9, self.beta2), frequency_scaling=frequency_scaling,
            second_moment="entry" if self.second_moment == "entry" else "row",
            row_blocks=policy.offsets if self.second_moment == "series" else None,
            convexity_correction=self.convexity_correction,
        )  # fmt: skip


#: how the paired estimators' op effects step the logits (``step_rule`` of :class:`PolicyUpdater`)
POLICY_STEPS: Registry[StepRule] = Registry("policy step rule")
POLICY_STEPS.register(
    StepRule("adam", "the softmax gradient of the expected effect, each logit scaled by its own Adam second moment")
)
POLICY_STEPS.register(
    StepRule(
        "natural",
        "the natural gradient (each op's effect less its series' baseline), scaled by one second moment per "
        "class group: an op moves in proportion to its effect (beyond the paper; paired estimators only)",
        natural=True,
        second_moment="group",
    )
)
POLICY_STEPS.register(
    StepRule(
        "natural-series",
        "the natural gradient scaled by one second moment per class group and series: ops move in "
        "proportion to their effects within their series, every series at about the learning rate (research)",
        natural=True,
        second_moment="series",
    )
)
POLICY_STEPS.register(
    StepRule(
        "natural-recent",
        "the natural gradient scaled by one second moment per class group that follows the last ~50 "
        "updates (beta2 0.98), so the effects measured late move the policy as far as the first ones (the "
        "synthetic bundle's default before natural-unbiased)",
        natural=True,
        second_moment="group",
        beta2=0.98,
    )
)
POLICY_STEPS.register(
    StepRule(
        "natural-unbiased",
        "natural-recent whose steps subtract half their measured part's square (at most 0.5 logit a step), so "
        "that effects of pure noise leave the probabilities unchanged in expectation (without it, noise alone "
        "makes rare ops likelier; the synthetic bundle's default, with a constant learning rate)",
        natural=True,
        second_moment="group",
        beta2=0.98,
        convexity_correction=True,
    )
)

PrepareBatch = Callable[[Mapping, torch.device], tuple[torch.Tensor, torch.Tensor]]


class SkipUpdate(Exception):
    """Raised inside an update to skip it (the reason is warned about once)."""


def plain(x: torch.Tensor) -> torch.Tensor:
    return x.as_tensor() if hasattr(x, "as_tensor") else x


def as_batch(batch: Mapping | Sequence) -> Mapping:
    """A dictionary batch; MONAI engines decollate ``state.batch`` into a list of samples by the time
    ITERATION_COMPLETED fires, which is collated back here."""
    if isinstance(batch, Mapping):
        return batch
    if isinstance(batch, Sequence) and batch and isinstance(batch[0], Mapping):
        return list_data_collate(list(batch))
    raise TypeError(f"expected a dictionary batch (or a list of sample dictionaries), got {type(batch).__name__}")


def make_prepare_batch(image_key: str = "image", label_key: str = "label") -> PrepareBatch:
    """Default batch preparation: ``(batch[image_key], batch[label_key])`` as plain tensors on ``device``."""

    def prepare(batch: Mapping, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        missing = [k for k in (image_key, label_key) if k not in batch]
        if missing:
            raise KeyError(f"batch has no key(s) {missing}; keys are {list(batch)}")
        return plain(batch[image_key]).to(device), plain(batch[label_key]).to(device)

    return prepare


def unwrap_model(model: nn.Module) -> nn.Module:
    """The network inside a ``DistributedDataParallel`` (or ``DataParallel``) wrapper; others as they are."""
    return model.module if isinstance(model, (DistributedDataParallel, DataParallel)) else model


class ValidationStream:
    """Endless iteration over a validation loader (a new pass starts when one ends)."""

    def __init__(self, loader: Iterable | None) -> None:
        self.loader = loader
        self._it: Iterator | None = None

    def restart(self) -> None:
        """Start the next batch from a fresh pass over the loader."""
        self._it = None

    def next(self) -> Mapping | None:
        """The next batch, or ``None`` if the loader yields nothing at all."""
        if self.loader is None:
            return None
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
        return None


class PolicyUpdater(ABC):
    """Base of the Ignite handlers that update a policy every ``update_every`` iterations.

    Args:
        policy: the policy to learn (kept on the CPU).
        model: the segmentation network being trained.
        lr: the policy's Adam learning rate (beta for TRA, gamma for TEA); ignored when ``logit_budget`` is set.
        update_every: update on every N-th iteration.
        poly_power: the policy lr decays as ``lr * (1 - t / T) ** poly_power`` over the run, like the
            model's; ``0`` keeps it constant.
        logit_budget: derive the learning rate from the run's length instead: when the run starts, the lr is
            set so that the decayed learning rates of all planned updates sum to ``logit_budget``. An Adam step
            moves a logit by about the learning rate when its gradient keeps its sign, so this is the most a
            logit that takes part in every update can move over the whole run, and the same default suits a
            500-iteration demo and a 100k-iteration run (a logit that takes part in a share ``f`` of the
            updates moves at most ``f * logit_budget``, unless ``frequency_scaling``).
        frequency_scaling: scale each logit's step by the inverse of the share of updates it took part in
            (:class:`~jcsaug.engine.optim.MaskedAdam`), so that every logit can move ``logit_budget`` over a run
            however rarely it is measured; the paired estimators use it.
        start: the share of the run's planned iterations that passes before the first update (0: update from the
            first iteration). Until then the policy keeps its initial probabilities and the updater costs nothing;
            a logit budget is spread over the updates after it. A warm-up for the TRA, whose first effects are
            measured on an untrained network (what it changes: ``benchmarks/README.md``, "A warm-up, a constant
            β…").
        step_rule: how the paired estimators' op effects move the logits (:data:`POLICY_STEPS`). ``"adam"``: the
            softmax gradient ``pi_m (D_m - b)``, each logit with its own Adam second moment, so an op whose effect
            keeps its sign moves by about the learning rate per step however small the effect. ``"natural"``: the
            natural gradient ``D_m - b`` (no factor ``pi``) with one Adam second moment per class group
            (:class:`~jcsaug.engine.optim.MaskedAdam` ``second_moment="row"``), so ops move in proportion to
            their effects, and a rare op as readily as a frequent one (beyond the paper; measured in
            ``benchmarks/README.md``, "Op effects stepped in proportion").
            ``"natural-series"``: the same gradient with one second moment per class group *and series*
            (``row_blocks`` = the policy's series offsets), so a series of small effects (a gamma, a noise) moves
            as far as one of large effects (a rotation); ``"natural-recent"``: one second moment per class group
            that follows the last ~50 updates (Adam's ``beta2`` 0.98, not 0.999), so the small effects measured
            late move the policy as far as the large early ones (``natural-series``: research; ``natural-recent``
            with a constant β: the synthetic bundle's default from 2026-11-29); ``"natural-unbiased"``:
            ``natural-recent`` with MaskedAdam's ``convexity_correction`` (clipped at 0.5 logit a step), so that
            effects of pure noise leave the ops' probabilities where they are in expectation (with the others noise
            alone makes the rare ops likelier: ``benchmarks/bench_step_noise.py``; with a constant β the synthetic
            bundle's default since 2026-11-30; all in ``benchmarks/README.md``).
        pull: how far the logits fade back to their initial values over the planned run, in e-folds (0: never):
            before each step, every logit the step moves first decays towards its initial value at a rate of
            ``1 - exp(-pull / planned updates)`` per update (:class:`~jcsaug.engine.optim.MaskedAdam` ``pull``), so
            at the end of the run a step taken at its share ``t`` counts ``exp(-pull * (1 - t))``: credit that the
            first epochs gave an op and later ones do not confirm fades back towards the preset.
        seed: seed of the update's own random stream (Gumbel noise, TEA op draws); each rank of a distributed
            run adds its rank, so the ranks draw different ops.
        name: used in logs and TensorBoard tags.
        planned_epochs: the epochs the poly decay, the logit budget and ``start`` plan over (times the engine's
            ``epoch_length``); None: the engine's ``max_epochs`` (or ``max_iters``) when the run starts. For a
            training run in pieces whose ``max_epochs`` is one piece's end (MONAI FL's rounds).

    The state (:meth:`state_dict`) is per rank in distributed runs: the random stream, and the running estimates
    made from the rank's own batches (op effects, look-ahead, validation-gradient average).
    :class:`~jcsaug.engine.resume.ResumeCheckpoint` saves and restores it for every rank (``rank_local_state``).
    :meth:`resume_settings` are the arguments that shape the run's trajectory; a resume must keep them.

    Distributed runs (``torch.distributed`` initialised, world size > 1): every update is collective. The
    ranks' policy gradients (and drawn-op masks) are all-reduced before each Adam step, so the policies
    stay identical on every rank; a rank that skips an update still joins the all-reduce (with no
    gradient) and steps with the others' mean. Set ``sync_ranks = False`` for an updater run on one rank
    only (e.g. post-hoc TEA learning during a rank-0 evaluation).
    """

    sync_ranks: bool = True
    #: the state differs between ranks (see the class docstring): resume checkpoints keep one per rank
    rank_local_state: bool = True
    #: added to ``seed`` for this kind of updater's stream, so that two kinds seeded alike draw independently
    seed_offset: int = 0

    def __init__(
        self,
        policy: CategoricalPolicy,
        model: nn.Module,
        lr: float,
        update_every: int = 1,
        poly_power: float = 0.9,
        seed: int = 0,
        name: str = "policy",
        logit_budget: float | None = None,
        frequency_scaling: bool = False,
        start: float = 0.0,
        step_rule: str = "adam",
        planned_epochs: int | None = None,
        pull: float = 0.0,
    ) -> None:
        if update_every < 1:
            raise ValueError(f"update_every must be >= 1, got {update_every}")
        if lr < 0 or not math.isfinite(lr):
            raise ValueError(f"policy learning rate must be finite and >= 0, got {lr}")
        if logit_budget is not None and (not math.isfinite(logit_budget) or logit_budget <= 0):
            raise ValueError(f"logit_budget must be finite and > 0, got {logit_budget}")
        if not math.isfinite(poly_power) or poly_power < 0:
            raise ValueError(f"poly_power must be finite and >= 0 (0: a constant learning rate), got {poly_power}")
        if not 0.0 <= start < 1.0:
            raise ValueError(f"start must be a share of the run in [0, 1), got {start}")
        if not math.isfinite(pull) or pull < 0:
            raise ValueError(f"pull must be finite and >= 0 (e-folds over the run; 0: none), got {pull}")
        if planned_epochs is not None and (isinstance(planned_epochs, bool) or int(planned_epochs) != planned_epochs
                                           or planned_epochs < 1):  # fmt: skip
            raise ValueError(f"planned_epochs must be None or an integer >= 1, got {planned_epochs!r}")
        self.planned_epochs = None if planned_epochs is None else int(planned_epochs)
        self.policy = policy
        self.wrapped_model = model
        self.base_lr = float(lr)
        self.update_every = int(update_every)
        self.poly_power = float(poly_power)
        self.name = name
        self.logit_budget = None if logit_budget is None else float(logit_budget)
        self.step_rule = POLICY_STEPS.key(step_rule)  # an unknown name: an error listing the valid ones
        self.optimizer = POLICY_STEPS.get(self.step_rule).optimizer(policy, lr, frequency_scaling)
        self.seed = int(seed)
        self.generator = torch.Generator().manual_seed(self.seed + self.seed_offset + idist.get_rank())
        # what a resume must keep (the budget replaces lr when given: lr is then no setting of the run)
        self._settings: dict[str, float | int | str | bool | None] = {
            "seed": self.seed, "update_every": self.update_every, "poly_power": self.poly_power,
            **({"lr": self.base_lr} if self.logit_budget is None else {"logit_budget": self.logit_budget}),
        }  # fmt: skip
        self.start = float(start)
        # (checkpoints saved before these were recorded ran with 0 and Adam: resume.UPDATER_SETTINGS_BEFORE_SAVED)
        self._settings.update(start=self.start, step_rule=self.step_rule)
        self.pull = float(pull)
        if self.pull:  # saved only when set, so the checkpoints of every run without it are unchanged
            self._settings["pull"] = self.pull
        self.updates = 0
        self.skipped = 0
        self.skip_reasons: Counter[str] = Counter()  # reason -> how many updates it skipped
        self._warned: set[str] = set()
        self.last_changes: list[tuple[str, float]] = []  # (series/op, signed change), when DEBUG logging is on
        self._synced = False  # whether this update has joined the ranks' all-reduce
        self.effects: OpEffects | None = None  # running op effects of the paired estimators

    def _paired_effects(self, estimator: str, smoothing: float) -> OpEffects | None:
        """The running op effects of the paired estimator (stepped by this updater's ``step_rule``); ``None`` for
        the others, which measure no effects and so take Adam steps only."""
        natural = POLICY_STEPS.get(self.step_rule).natural
        if estimator == "paired":
            return OpEffects(self.policy, smoothing, natural=natural)
        if natural:
            raise ValueError(f"step_rule {self.step_rule!r} needs the paired estimator (op effects), got {estimator!r}")
        return None

    @property
    def model(self) -> nn.Module:
        """The network the extra (meta) passes run on: the trainer's network, unwrapped from DDP.

        The meta passes must not go through ``DistributedDataParallel``: its forward would prepare the
        gradient reducer for a backward that never comes (``autograd.grad`` / ``functional_call`` /
        ``no_grad`` passes), which breaks the trainer's next iteration, and it may broadcast buffers, a
        collective that deadlocks as soon as one rank skips an update. The wrapped module shares its
        parameters with the wrapper, so ``theta`` snapshots and the trainer's steps see the same tensors.
        """
        return unwrap_model(self.wrapped_model)

    @property
    def distributed(self) -> bool:
        return self.sync_ranks and idist.get_world_size() > 1

    # ------------------------------------------------------------------ ignite
    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self._plan_learning_rate)
        engine.add_event_handler(Events.ITERATION_COMPLETED(every=self.update_every), self._run_update)
        engine.add_event_handler(Events.EPOCH_STARTED, self._start_epoch)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._log_epoch)

    def _plan_learning_rate(self, engine: Engine) -> None:
        """With a ``logit_budget``: the base lr from the run's planned updates (see the class docstring).

        Checks first that the run's length is known when the schedule needs it (a poly decay or a budget)."""
        if self.logit_budget is None and self.poly_power == 0 and not self.start and not self.pull:
            return  # a constant lr from the first iteration: the run's length does not matter
        total = self._total_iterations(engine)  # raises, naming the fix, before the first iteration rather than later
        if self.pull:
            rate = -math.expm1(-self.pull / max(len(self._planned_update_iterations(total)), 1))
            for group in self.optimizer.param_groups:
                group["pull"] = rate
        if self.logit_budget is None:
            return
        self.base_lr = self.lr_for_budget(self.logit_budget, total)
        logger.debug("%s learning rate %.3g from a logit budget of %g", self.name, self.base_lr, self.logit_budget)

    def lr_for_budget(self, budget: float, total_iterations: int) -> float:
        """The base lr whose poly-decayed values over this updater's planned updates sum to ``budget``."""
        total = max(total_iterations, 1)
        steps = self._planned_update_iterations(total)
        if steps.numel() == 0:
            return 0.0
        return float(budget / ((1.0 - (steps - 1) / total) ** self.poly_power).sum())  # every term > 0: steps <= total

    def _planned_update_iterations(self, total_iterations: int) -> torch.Tensor:
        """The iterations (1-based, float64) at which the planned run updates the policy, after any warm-up."""
        total = max(total_iterations, 1)
        if self.update_every > total:  # no update planned (and torch.arange refuses a range that ends before it starts)
            return torch.zeros(0, dtype=torch.float64)
        steps = torch.arange(self.update_every, total + 1, self.update_every, dtype=torch.float64)
        return steps[steps >= self._first_iteration(total)]  # none during a warm-up (``start``)

    def warming_up(self, engine: Engine, iteration: int | None = None) -> bool:
        """Whether the engine's current iteration (or ``iteration``, 1-based) comes before the first update (see
        ``start``)."""
        iteration = engine.state.iteration if iteration is None else iteration
        return bool(self.start) and iteration < self._first_iteration(self._total_iterations(engine))

    def updates_at(self, engine: Engine, iteration: int) -> bool:
        """Whether this updater runs an update at the end of the engine's iteration ``iteration`` (1-based): every
        ``update_every``-th, after the warm-up (an update may still be skipped, e.g. on a non-finite loss)."""
        return iteration % self.update_every == 0 and not self.warming_up(engine, iteration)

    def _first_iteration(self, total_iterations: int) -> int:
        """The first iteration (1-based) that may update the policy: the first after ``start`` of the run."""
        return math.floor(self.start * total_iterations) + 1

    def _total_iterations(self, engine: Engine) -> int:
        """The run's planned iterations: ``planned_epochs`` x ``epoch_length`` when set, else ``max_iters`` when
        ``engine.run`` was given it, else ``max_epochs`` x ``epoch_length``. Data without a length and no
        ``epoch_length`` leave it unknown until the first epoch ends: an error then, since the poly decay and the
        logit budget are planned over the whole run."""
        state = engine.state
        if self.planned_epochs is not None and state.epoch_length is not None:
            return self.planned_epochs * int(state.epoch_length)
        if getattr(state, "max_iters", None):
            return int(state.max_iters)
        if state.epoch_length is None or state.max_epochs is None:
            raise ValueError(
                f"{self.name} updater: the run's length is unknown (the data has no len() and engine.run got no "
                "epoch_length), but the policy learning rate is planned over it (poly_power="
                f"{self.poly_power:g}, logit_budget={self.logit_budget}); pass epoch_length (or max_iters) to "
                "engine.run, or set poly_power=0 and no logit_budget"
            )
        return int(state.max_epochs * state.epoch_length)

    def _run_update(self, engine: Engine) -> None:
        if self.warming_up(engine):
            return  # no update, no cost
        log = logger.isEnabledFor(logging.DEBUG)  # the per-update changes are only worth computing if shown
        before = self.policy.probabilities() if log else None
        self._synced = False
        try:
            self.update(engine)
        except SkipUpdate as reason:
            self.skip(str(reason))
            if not self.distributed or self._synced:
                return
            try:  # join the other ranks' all-reduce without a gradient, and step with their mean
                self._apply_gradient(engine, None, None)
            except SkipUpdate:
                return
        self.updates += 1
        if before is not None:
            self._log_changes(engine, before)

    @abstractmethod
    def update(self, engine: Engine) -> None:
        """One policy update; raise :class:`SkipUpdate` to skip it."""

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        try:
            return next(self.model.parameters()).device
        except StopIteration:
            return torch.device("cpu")

    def skip(self, reason: str) -> None:
        self.skipped += 1
        self.skip_reasons[reason] += 1
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"{self.name} update skipped: {reason} (warned once; training goes on)", stacklevel=2)
        logger.debug("%s update skipped: %s", self.name, reason)

    def current_lr(self, engine: Engine) -> float:
        if self.poly_power == 0:
            return self.base_lr
        total = self._total_iterations(engine)
        progress = min(max((engine.state.iteration - 1) / max(total, 1), 0.0), 1.0)
        return self.base_lr * (1.0 - progress) ** self.poly_power

    def step(self, engine: Engine, surrogate: torch.Tensor, drawn: torch.Tensor | None = None) -> None:
        """Backpropagate ``surrogate`` into the logits, all-reduce across ranks, check, and step Adam.

        ``drawn`` (``[groups, logits]`` bool) restricts the step to the ops drawn in this update (on any
        rank), as the paper's normalisation promises: an op that was not sampled keeps its logit and its Adam
        state (:class:`~jcsaug.engine.optim.MaskedAdam`). Without the mask it would get the small
        softmax-coupling term ``-sum_i h_i s_ik s_ij``, which Adam's per-coordinate scaling would blow up
        into a full-sized, noise-driven step.
        """
        self.optimizer.zero_grad(set_to_none=True)
        surrogate.backward()
        grad = self.policy.logits.grad
        if grad is None and not self.distributed:
            raise SkipUpdate("no gradient reached the policy")
        self._apply_gradient(engine, grad, drawn)

    def _apply_gradient(self, engine: Engine, grad: torch.Tensor | None, drawn: torch.Tensor | None) -> None:
        """Mask, check and apply a logits gradient; collective (all ranks' mean) in distributed runs.

        ``grad is None`` (distributed only) joins the all-reduce without contributing."""
        logits = self.policy.logits
        if self.distributed:
            grad, drawn = self._all_reduce(grad, drawn)
            if grad is None:
                self.optimizer.zero_grad(set_to_none=True)
                raise SkipUpdate("no rank had a policy gradient")
        logits.grad = grad
        if drawn is not None:
            drawn = drawn.to(grad.device)
            grad.masked_fill_(~drawn, 0.0)
        if not torch.isfinite(grad).all():
            self.optimizer.zero_grad(set_to_none=True)
            raise SkipUpdate("non-finite policy gradient")
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr(engine)
        self.optimizer.step(mask=drawn)

    def _all_reduce(
        self, grad: torch.Tensor | None, drawn: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One all-reduce of ``[gradient, drawn mask, contributed]`` over the ranks.

        Returns the mean gradient of the contributing ranks and the union of their drawn masks (all ops
        where a rank passed no mask), or ``(None, None)`` when no rank contributed. Every rank gets the
        same bits, so the Adam steps, and hence the policies, stay identical."""
        self._synced = True
        logits = self.policy.logits
        n = logits.numel()
        packed = torch.zeros(2 * n + 1, dtype=torch.float64)
        if grad is not None:
            packed[:n] = grad.detach().reshape(-1).to("cpu", torch.float64)
            packed[n : 2 * n] = 1.0 if drawn is None else drawn.reshape(-1).to("cpu", torch.float64)
            packed[-1] = 1.0
        packed = idist.all_reduce(packed)
        count = float(packed[-1])
        if count == 0:
            return None, None
        mean = (packed[:n] / count).reshape(logits.shape).to(logits.device, logits.dtype)
        return mean, (packed[n : 2 * n] > 0).reshape(logits.shape)

    def _most_changed(
        self, before: list[torch.Tensor], top: int = 3
    ) -> list[tuple[str, float]]:  # pragma: no mutate block (logging)
        """The ``top`` ops whose probability changed most since ``before``, each for the class group where it
        changed most, with the signed change."""
        after = self.policy.probabilities()
        changes = []
        for s, (b, a) in enumerate(zip(before, after)):
            delta = a - b  # [groups, ops]: report, per op, the group that changed most (with its sign)
            diff = delta.gather(0, delta.abs().argmax(0, keepdim=True))[0]
            for j in range(len(diff)):
                changes.append((f"{self.policy.series_names[s]}/{self.policy.op_names[s][j]}", float(diff[j])))
        changes.sort(key=lambda c: -abs(c[1]))
        return changes[:top]

    def _log_changes(self, engine: Engine, before: list[torch.Tensor]) -> None:  # pragma: no mutate block (logging)
        """One DEBUG line per update (INFO gets one line per epoch, :meth:`_log_epoch`)."""
        self.last_changes = self._most_changed(before)
        logger.debug(
            "iteration %d: %s update %d; most changed: %s",
            engine.state.iteration,
            self.name,
            self.updates,
            ", ".join(f"{n} ({d:+.2e})" for n, d in self.last_changes),
        )

    def _start_epoch(self, engine: Engine) -> None:  # pragma: no mutate block (logging)
        self._epoch_start = (
            self.updates,
            self.skipped,
            self.policy.probabilities() if logger.isEnabledFor(logging.INFO) else None,
        )

    def _log_epoch(self, engine: Engine) -> None:  # pragma: no mutate block (logging)
        """One INFO line per epoch: updates done and skipped in it, and the ops that changed most in it."""
        start = getattr(self, "_epoch_start", None)
        if start is None or start[2] is None or not logger.isEnabledFor(logging.INFO):
            return
        updates, skipped, before = self.updates - start[0], self.skipped - start[1], start[2]
        changed = ", ".join(f"{n} ({d:+.2e})" for n, d in self._most_changed(before)) if updates else "none"
        logger.info(
            "epoch %d: %s policy %d updates, %d skipped; most changed this epoch: %s",
            engine.state.epoch,
            self.name,
            updates,
            skipped,
            changed,
        )

    # ------------------------------------------------------------------ checkpoints
    def resume_settings(self) -> dict:
        """The arguments that shape this updater's trajectory (seed, update interval, learning rate...), plain
        values: saved with its state, and a resume with other ones is refused
        (:func:`~jcsaug.engine.resume.check_resume_matches`)."""
        return dict(self._settings)

    def state_dict(self) -> dict:
        """Tensors and plain Python values only (loads with ``torch.load(weights_only=True)``)."""
        state = {
            "settings": self.resume_settings(),  # read by resume checks, never loaded
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "updates": self.updates,
            "skipped": self.skipped,
            "skip_reasons": dict(self.skip_reasons),
        }
        if self.effects is not None:
            state["effects"] = self.effects.state_dict()
        return state

    def load_state_dict(self, state: Mapping) -> None:
        missing = {"policy", "optimizer", "generator"} - set(state)
        if missing:
            raise KeyError(f"{self.name} state is missing {sorted(missing)}")
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.updates = int(state.get("updates", 0))
        self.skipped = int(state.get("skipped", 0))
        self.skip_reasons = Counter({str(k): int(v) for k, v in dict(state.get("skip_reasons", {})).items()})
        if self.effects is not None and "effects" in state:
            self.effects.load_state_dict(state["effects"])
