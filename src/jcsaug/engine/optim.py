"""Adam on the policy logits, stepping only the entries an update chose (SPEC §4: "unchanged" means the logits
*and* their optimiser state)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

__all__ = ["MaskedAdam"]


class MaskedAdam(torch.optim.Optimizer):
    """Adam whose :meth:`step` updates only the entries selected by a boolean ``mask``.

    Entries outside the mask keep their value, both moments *and* their own step count, bit for bit; with
    ``mask=None`` (or all true) every step equals ``torch.optim.Adam``'s (same update formula and bias
    correction).

    With ``frequency_scaling=True`` an entry's step is multiplied by ``calls / steps``, the inverse of the share
    of steps it took part in (at most ``max_scale``): an op measured in one update out of ten moves ten times as
    far per measurement, so over a run every entry can move as far as one stepped every time (an importance
    weight for how often the estimator measures it).

    With ``second_moment="row"`` the second moment is shared by each row of the parameter (its first dimension:
    a policy's class group; a 1-D parameter is one row): the mean square of the row's stepped entries, averaged over
    the row's steps. An entry's step is then its first moment over the row's RMS, so entries move in proportion to
    their gradients (a consistently small gradient moves its entry little), where per-entry Adam moves every entry
    with a consistent sign by about the learning rate, however small its gradient. The entries of a row outside the
    mask then keep their value, first moment and step count, but share the row's new second moment. With
    ``row_blocks`` (column boundaries ``0 = b_0 < b_1 < ... < b_K`` = the row's length, e.g. a policy's series
    offsets) each block of a row has a second moment of its own instead: entries move in proportion to their
    gradients within their block, and every block at about the learning rate.

    With ``convexity_correction=True`` each selected entry also moves by ``-s**2 / 2``, where ``s = lr * scale *
    grad / sqrt(v)`` is the share of the logit's eventual displacement that this step's gradient adds (the first
    moment spreads it over later steps). For logits of a softmax with a dominant entry (a policy's identity), a
    step of zero mean and variance ``s**2`` raises ``exp(logit)``, and with it a rare op's probability, by a factor
    ``exp(s**2 / 2)`` in expectation: gradients of pure noise make every rare op likelier. The correction keeps
    ``exp(logit)`` unbiased to second order, so noise alone no longer moves probability towards the rare ops
    (``benchmarks/README.md``, "Noise alone makes the rare ops likelier"). The expansion holds for small steps
    (``|s|`` well below 1), so ``s`` is clipped to ``[-correction_clip, correction_clip]`` first: one step's
    correction is at most ``correction_clip**2 / 2`` (0.5 logit by default), where unclipped the square of a
    single large noisy step (``s`` up to 3.3 in the synthetic bundle) took 5.6 logits off an op, and a short run of
    large steps crushed a helpful op to probability 1e-13. An entry near probability 0.5 (a two-op series), where
    the logistic is not convex, is pushed down a little.

    With ``pull > 0`` each selected entry first moves towards its *anchor*, its value when the optimiser first
    stepped the tensor (a policy's initial logits), by a share ``1 - (1 - pull)**k`` of the distance, ``k`` the
    tensor's steps since the entry was last pulled: a decay at rate ``pull`` per step (a decoupled weight decay
    towards the anchor, as AdamW's towards 0), applied when the entry is next selected, so entries outside the mask
    still keep their value. The displacement is then an average of the steps that weighs the recent ones most (a
    step ``k`` steps ago counts ``(1 - pull)**k``): what early steps credited and no later one confirms fades back.

    Why by hand: ``torch.optim.Adam`` moves every entry through its first moment even where the gradient is
    zero (a masked logit kept moving by up to 67 % of a full step), and ``torch.optim.SparseAdam`` counts one
    step per tensor, so an entry first updated at step 100 gets a bias correction for 100 steps it never took
    (an oversized first step). Here each entry counts its own steps.

    Example:
        >>> logits = torch.nn.Parameter(torch.zeros(4))
        >>> opt = MaskedAdam([logits], lr=0.1)
        >>> logits.grad = torch.tensor([1.0, -1.0, 1.0, 1.0])
        >>> opt.step(mask=torch.tensor([True, True, False, False]))
        >>> logits.detach()
        tensor([-0.1000,  0.1000,  0.0000,  0.0000])
        >>> opt.state[logits]["step"]
        tensor([1., 1., 0., 0.])
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        frequency_scaling: bool = False,
        max_scale: float = 10.0,
        second_moment: str = "entry",
        row_blocks: Sequence[int] | None = None,
        convexity_correction: bool = False,
        correction_clip: float = 1.0,
        pull: float = 0.0,
    ) -> None:
        if lr < 0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if max_scale < 1:
            raise ValueError(f"max_scale must be >= 1, got {max_scale}")
        if not 0.0 <= pull < 1.0:
            raise ValueError(f"pull must be in [0, 1) (a share of the distance to the anchor per step), got {pull}")
        if not correction_clip > 0:
            raise ValueError(f"correction_clip must be > 0, got {correction_clip}")
        if second_moment not in ("entry", "row"):
            raise ValueError(f"second_moment must be 'entry' or 'row', got {second_moment!r}")
        if row_blocks is not None:
            row_blocks = tuple(int(b) for b in row_blocks)
            if second_moment != "row":
                raise ValueError(f"row_blocks {row_blocks} needs second_moment='row', got {second_moment!r}")
            if len(row_blocks) < 2 or row_blocks[0] != 0 or any(a >= b for a, b in zip(row_blocks, row_blocks[1:])):
                raise ValueError(f"row_blocks must rise strictly from 0 to the row's length, got {row_blocks}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "frequency_scaling": bool(frequency_scaling),
                    "max_scale": float(max_scale), "second_moment": second_moment,
                    "row_blocks": row_blocks, "convexity_correction": bool(convexity_correction),
                    "correction_clip": float(correction_clip), "pull": float(pull)}  # fmt: skip
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``; a setting the saved groups lack (a state saved before the
        setting existed, e.g. ``convexity_correction``) keeps this optimiser's value instead of vanishing."""
        options = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, own in zip(self.param_groups, options):
            for key, value in own.items():
                group.setdefault(key, value)

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["calls"] = torch.zeros((), dtype=torch.float64)  # steps of the tensor, whatever the mask
            state["step"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["anchor"] = p.detach().clone(memory_format=torch.preserve_format)  # pulled towards (``pull``)
            state["pulled"] = torch.zeros_like(p, dtype=torch.float64)  # the tensor's steps at each entry's last pull
        elif state["step"].shape != p.shape:  # a checkpoint of torch.optim.Adam: one step count per tensor
            state["calls"] = torch.tensor(float(state["step"]), dtype=torch.float64)
            state["step"] = torch.full_like(p, float(state["step"]))
        state.setdefault("calls", state["step"].max().double())
        if "anchor" not in state:  # a state saved before the pull: its anchor is lost, the value now stands for it
            state["anchor"] = p.detach().clone(memory_format=torch.preserve_format)
            state["pulled"] = torch.full_like(p, float(state["calls"]), dtype=torch.float64)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, mask: torch.Tensor | None = None) -> float | None:
        """One Adam step on the entries where ``mask`` is true (all entries if ``mask`` is None).

        ``mask`` must have the parameter's shape; with several parameters pass ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if mask is not None and tuple(mask.shape) != tuple(p.shape):
                    raise ValueError(f"mask of shape {tuple(mask.shape)} for a parameter of shape {tuple(p.shape)}")
                sel = torch.ones_like(p, dtype=torch.bool) if mask is None else mask.to(p.device, torch.bool)
                state = self._state_of(p)
                grad = p.grad
                if group.get("pull", 0.0) > 0:
                    self._pull(p, state, sel, group["pull"])
                step = torch.where(sel, state["step"] + 1, state["step"])
                exp_avg = torch.where(sel, state["exp_avg"] * beta1 + (1 - beta1) * grad, state["exp_avg"])
                safe_step = step.clamp(min=1)  # entries never stepped: any value, they are masked out below
                row_wise = group.get("second_moment", "entry") == "row"
                if row_wise:
                    bounds = _block_bounds(group.get("row_blocks"), _rows(p).shape[1])
                    exp_avg_sq, row_step, second_steps = self._row_second_moment(state, grad, sel, beta2, bounds)
                else:
                    exp_avg_sq = torch.where(
                        sel, state["exp_avg_sq"] * beta2 + (1 - beta2) * grad * grad, state["exp_avg_sq"]
                    )
                    second_steps = safe_step
                # bias corrections in float64, as torch.optim.Adam computes them (from a Python float step)
                step_size = (group["lr"] / (1 - beta1 ** safe_step.double())).to(p.dtype)
                bias2_sqrt = (1 - beta2 ** second_steps.double()).sqrt().to(p.dtype)
                denom = exp_avg_sq.sqrt() / bias2_sqrt + group["eps"]
                calls = state["calls"] + 1
                scale: torch.Tensor | float = 1.0
                if group.get("frequency_scaling", False):
                    scale = (calls / safe_step.double()).clamp(max=group["max_scale"]).to(p.dtype)
                    step_size = step_size * scale
                update = step_size * (exp_avg / denom)
                if group.get("convexity_correction", False):
                    measured = group["lr"] * scale * grad / denom  # this gradient's share of the displacement
                    clip = group.get("correction_clip", 1.0)
                    measured = measured.clamp(-clip, clip)  # the second-order expansion holds for small steps only
                    update = update + measured * measured / 2
                p.copy_(torch.where(sel, p - update, p))
                state["step"], state["exp_avg"], state["exp_avg_sq"] = step, exp_avg, exp_avg_sq
                state["calls"] = calls
                if row_wise:
                    state["row_step"] = row_step  # how many steps each row (block) took: its own bias correction
        return loss

    @staticmethod
    def _pull(p: torch.Tensor, state: dict, sel: torch.Tensor, pull: float) -> None:
        """Move the selected entries towards their anchor by the decay of the steps since their last pull."""
        elapsed = state["calls"] + 1 - state["pulled"]  # this step included
        keep = ((1.0 - pull) ** elapsed).to(p.dtype)
        anchor = state["anchor"].to(p.device)
        p.copy_(torch.where(sel, anchor + (p - anchor) * keep, p))
        state["pulled"] = torch.where(sel.to(state["pulled"].device), state["calls"] + 1, state["pulled"])

    @staticmethod
    def _row_second_moment(
        state: dict, grad: torch.Tensor, sel: torch.Tensor, beta2: float, bounds: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The shared second moment of each block of each row (every entry holds its block's), the blocks' step
        counts ``[rows, blocks]`` (kept in the state) and each entry's block step count (at least 1, for the bias
        correction); ``bounds`` are the blocks' column boundaries.

        A block steps when any of its entries is selected; its new square is the mean square of the selected
        entries' gradients."""
        g2, rows_sel = _rows(grad * grad), _rows(sel)
        previous_moments = _rows(state["exp_avg_sq"])
        blocks = list(zip(bounds, bounds[1:]))
        moments, stepped = [], []
        for a, b in blocks:  # a few series: a loop of slices sums as the one-block row moment did, bit for bit
            block_sel = rows_sel[:, a:b]
            squares, count = (g2[:, a:b] * block_sel).sum(dim=1, keepdim=True), block_sel.sum(dim=1, keepdim=True)
            previous = previous_moments[:, a : a + 1]
            stepped.append(block_sel.any(dim=1, keepdim=True))
            moments.append(torch.where(stepped[-1], previous * beta2 + (1 - beta2) * (squares / count.clamp(min=1)),
                                       previous))  # fmt: skip
        moment, any_stepped = torch.cat(moments, dim=1), torch.cat(stepped, dim=1)
        steps = state.get("row_step", torch.zeros_like(moment))
        block_step = torch.where(any_stepped, steps + 1, steps)
        sizes = torch.tensor([b - a for a, b in blocks], device=grad.device)
        per_entry = (moment, block_step.clamp(min=1))
        moment, entry_steps = (t.repeat_interleave(sizes, dim=1).reshape(grad.shape) for t in per_entry)
        return moment, block_step, entry_steps


def _block_bounds(row_blocks: Sequence[int] | None, columns: int) -> tuple[int, ...]:
    """The blocks' column boundaries (``row_blocks``; ``None``: the whole row one block)."""
    if row_blocks is None:
        return (0, columns)
    if row_blocks[-1] != columns:
        raise ValueError(f"row_blocks {tuple(row_blocks)} end at {row_blocks[-1]}, the rows have {columns} entries")
    return tuple(row_blocks)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, entries]``: its first dimension the rows (a 1-D or 0-D tensor is one row)."""
    return t.reshape(t.shape[0], -1) if t.dim() >= 2 else t.reshape(1, -1)
