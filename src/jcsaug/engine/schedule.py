"""A warning for an epoch that starts after the network's learning-rate schedule has ended.

MONAI FL's ``MonaiAlgo`` sets a bundle's ``max_epochs`` property to one round's local epochs and raises the trainer's
``max_epochs`` by that much every round; a schedule planned over ``max_epochs`` (the bundles' ``PolynomialLR``) then
ends after the first round, and every later round trains at learning rate 0, silently. The bundles' ``planned_epochs``
plans the schedules over the whole training instead; this handler says when a run goes past what was planned.
"""

from __future__ import annotations

import logging

from ignite.engine import Engine, Events

logger = logging.getLogger("jcsaug.engine")


class WarnAfterSchedule:
    """Warn once, at the start of the first epoch after ``lr_scheduler`` has run its ``total_iters`` steps (an
    epoch-level ``PolynomialLR``: the network's learning rate is 0 from then on).

    Args:
        lr_scheduler: a scheduler with ``total_iters`` and ``last_epoch`` (``PolynomialLR``, ``LinearLR``, ...);
            one without ``total_iters`` never warns.
        setting: the bundle id that plans the schedule, named in the warning.

    Example:
        >>> import torch
        >>> from ignite.engine import Engine
        >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=1)
        >>> engine = Engine(lambda engine, batch: optimizer.step())  # your training step
        >>> handler = WarnAfterSchedule(scheduler)
        >>> handler.attach(engine)
        >>> _ = engine.add_event_handler(Events.EPOCH_COMPLETED, lambda engine: scheduler.step())
        >>> _ = engine.run([0], max_epochs=2)  # epoch 2 starts at learning rate 0: a warning
        >>> handler.warned
        True
    """

    def __init__(self, lr_scheduler: object, setting: str = "planned_epochs") -> None:
        self.lr_scheduler = lr_scheduler
        self.setting = setting
        self.warned = False

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, self)

    def __call__(self, engine: Engine) -> None:
        total = getattr(self.lr_scheduler, "total_iters", None)
        if self.warned or total is None or self.lr_scheduler.last_epoch < total:
            return
        self.warned = True
        rates = ", ".join(f"{group['lr']:.3g}" for group in self.lr_scheduler.optimizer.param_groups)
        logger.warning(
            "epoch %d starts after the learning-rate schedule ended (%s planned over %d epoch(s)): the network trains "
            "at learning rate %s from here. Set %s to the epochs of the whole training (MONAI FL: rounds x "
            "local_epochs, since MonaiAlgo sets max_epochs to one round's)",
            engine.state.epoch, type(self.lr_scheduler).__name__, total, rates, self.setting,
        )  # fmt: skip
