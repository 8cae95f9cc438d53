"""Ignite handler: draw the run's policies (and their history) to PNG files at the end of training."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events

from jcsaug.policy.categorical import CategoricalPolicy

logger = logging.getLogger("jcsaug.engine")


class PolicyPlotter:
    """At ``Events.COMPLETED`` (rank 0 only) write ``output_dir/policies.png`` (the policies, and the ops whose
    probabilities changed most since the plotter was made, i.e. from the start of training) and, if the run's
    :class:`~jcsaug.engine.PolicyExporter` wrote ``output_dir/policy_history.jsonl``,
    ``output_dir/policy_history.png``. Calling it draws them now.

    Plotting never fails training: without matplotlib one warning is logged and nothing is drawn;
    any other plotting error is logged as a warning. ``enabled=False`` draws nothing (the bundles' ``plots: false``:
    runs that need no figures, e.g. the many seeds of a benchmark, each a few seconds shorter).
    """

    def __init__(
        self,
        output_dir: str | Path,
        tra_policy: CategoricalPolicy | None = None,
        tea_policy: CategoricalPolicy | None = None,
        top_k: int = 12,
        history_top_k: int = 8,
        enabled: bool = True,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.enabled = bool(enabled)
        self.tra_policy, self.tea_policy = tra_policy, tea_policy
        self.top_k, self.history_top_k = top_k, history_top_k
        # the start the change panels compare against (copies: the policies are learned in place)
        self.initial = tuple(None if p is None else copy.deepcopy(p) for p in (tra_policy, tea_policy))
        self._warned = False
        self._drawn: list[torch.Tensor] = []  # the logits last drawn, and the files written then
        self._written: list[Path] = []

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.COMPLETED, self)

    def __call__(self, engine: Engine | None = None) -> list[Path]:
        """Write the figures now; returns the written paths (none on ranks other than 0)."""
        if not self.enabled or idist.get_rank() != 0 or (self.tra_policy is None and self.tea_policy is None):
            return []
        drawn = [p.logits.detach().clone() for p in (self.tra_policy, self.tea_policy) if p is not None]
        if self._written and all(torch.equal(a, b) for a, b in zip(drawn, self._drawn)):
            return list(self._written)  # nothing changed since the last drawing
        try:
            from jcsaug.viz.plots import _matplotlib, plot_policy, plot_policy_history  # noqa: PLC0415

            _matplotlib()
        except ImportError as err:
            if not self._warned:
                logger.warning("no policy plots: %s", err)
                self._warned = True
            return []
        written = []
        try:
            written.append(
                plot_policy(
                    (self.tra_policy, self.tea_policy),
                    self.output_dir / "policies.png",
                    top_k=self.top_k,
                    initial=self.initial,
                )
            )
            history = self.output_dir / "policy_history.jsonl"
            if history.is_file():
                written.append(
                    plot_policy_history(history, self.output_dir / "policy_history.png", top_k=self.history_top_k)
                )
        except Exception as err:  # a figure must never end a training run
            logger.warning("policy plots failed: %s", err, exc_info=True)
        self._drawn, self._written = drawn, written
        return written
