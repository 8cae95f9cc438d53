"""A look-ahead beyond one training step for the TRA hypergradient: a running Neumann series.

The one-step estimator scores a training sample by ``grad l_i . v`` with ``v = grad L_val``: will *one more*
step on this sample lower the validation loss now? A policy change, though, acts on every later step too. With
the training dynamics linearised around ``theta`` (Hessian ``H`` of the training loss), a change ``dg`` of the
expected training gradient held for ``K + 1`` steps of size ``alpha`` moves the validation loss by
``-alpha dg . u_K`` with

    u_K = sum_{j=0..K} (I - alpha H)^j v          (K -> infinity: u = H^-1 v / alpha, the implicit-function
                                                   hypergradient of Lorraine et al., 2020)

Directions the network has already learned (large curvature) are damped, slow directions kept: the sign can
differ from the one-step estimate once the network fits the augmented samples it has seen.

Why by hand: no maintained library computes a running inverse-Hessian-vector estimate for a live PyTorch training
loop (the Hessian-vector products are finite differences of two gradients, as the DARTS-style TRA estimator
itself; :func:`hessian_vector_products` also differentiates twice, ``exact=True``).

:class:`NeumannLookAhead` spends one Hessian-vector product per update instead of ``K``: it carries ``u`` over
updates, ``u_t = v_t + rho (I - alpha_t H_t) u_{t-1}`` with ``rho = 1 - 1/horizon``, so ``u_t`` is the Neumann
series over the last ~``horizon`` updates (with their own ``v`` and ``H``, as a running average would). The step
is scale-free: ``alpha_t = step / lambda_t``, ``lambda_t`` the largest curvature, tracked by a power iteration
(one more gradient per update), so ``alpha_t lambda_max ~ step < 2`` keeps the series bounded
whatever the loss's scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from jcsaug.engine.hypergradient import flat_norm, losses_at, pass_buffers, rewind_randomness, trainable_parameters
from jcsaug.engine.losses import PerSampleLoss

Vector = dict[str, torch.Tensor]


def hessian_vector_products(
    model: nn.Module,
    image: torch.Tensor,
    label: torch.Tensor,
    loss_fn: PerSampleLoss,
    vectors: list[Mapping[str, torch.Tensor]],
    exact: bool = False,
    r: float | None = None,
) -> list[Vector]:
    """``H x`` for every ``x`` of ``vectors``, ``H`` the Hessian of the mean training loss on ``(image, label)``
    with respect to the model's trainable parameters.

    By default by finite differences of gradients, ``H x ~ (grad(theta + eps x) - grad(theta)) / eps`` with
    ``eps = r / ||x||`` (one forward and backward pass per vector plus one shared: a conv net's double backward
    costs several times that, see ``bench_policy_learning.py`` section 5). The step's length ``r`` defaults to
    the usual rule for finite-difference Jacobian-vector products, ``sqrt(machine epsilon) * (1 + ||theta||)``
    (float32: 3.5e-4 x (1 + ||theta||)); ``exact=True`` differentiates twice (one forward, one backward with
    graph, one double backward per vector)."""
    params = trainable_parameters(model)
    if exact:
        return _exact_products(model, params, image, label, loss_fn, vectors)
    return _finite_difference_products(model, params, image, label, loss_fn, vectors, r)[0]


def _finite_difference_products(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    image: torch.Tensor,
    label: torch.Tensor,
    loss_fn: PerSampleLoss,
    vectors: list[Mapping[str, torch.Tensor]],
    r: float | None = None,
) -> tuple[list[Vector], Vector]:
    """``(H x for every x, the gradient at theta)``: the products and their base, the batch's gradient."""
    # in training mode every pass draws the same dropout masks and runs on copies of the buffers, so that the
    # difference of two gradients is the shift's effect alone and BatchNorm's running statistics stay as they were
    rewind = rewind_randomness(image.device)

    def gradient_at(shift: Mapping[str, torch.Tensor] | None, eps: float) -> Vector:
        point = {n: (p.detach() + eps * shift[n] if shift is not None else p.detach()).requires_grad_()
                 for n, p in params.items()}  # fmt: skip
        rewind()
        loss = losses_at(model, point, pass_buffers(model), image, label, loss_fn).mean()
        grads = torch.autograd.grad(loss, list(point.values()), allow_unused=True)
        return {n: g if g is not None else torch.zeros_like(p) for (n, p), g in zip(params.items(), grads)}

    if r is None:
        dtype = next(iter(params.values())).dtype
        r = torch.finfo(dtype).eps ** 0.5 * (1.0 + float(flat_norm({n: p.detach() for n, p in params.items()})))
    base = gradient_at(None, 0.0)
    out = []
    for x in vectors:
        norm = float(flat_norm(x))
        if norm == 0:
            out.append({n: torch.zeros_like(p) for n, p in params.items()})
            continue
        eps = r / norm
        shifted = gradient_at(x, eps)
        out.append({n: (shifted[n] - base[n]) / eps for n in params})
    return out, base


def _exact_products(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    image: torch.Tensor,
    label: torch.Tensor,
    loss_fn: PerSampleLoss,
    vectors: list[Mapping[str, torch.Tensor]],
) -> list[Vector]:
    loss = losses_at(model, params, pass_buffers(model), image, label, loss_fn).mean()  # buffers: see above
    grads = torch.autograd.grad(loss, list(params.values()), create_graph=True, allow_unused=True)
    used = [(name, g) for name, g in zip(params, grads) if g is not None and g.requires_grad]
    out = []
    for k, x in enumerate(vectors):
        hx = torch.autograd.grad([g for _, g in used], [params[n] for n, _ in used],
                                 grad_outputs=[x[n] for n, _ in used], retain_graph=k < len(vectors) - 1,
                                 allow_unused=True)  # fmt: skip
        result = {n: torch.zeros_like(p) for n, p in params.items()}
        result.update({n: h.detach() for (n, _), h in zip(used, hx) if h is not None})
        out.append(result)
    return out


class NeumannLookAhead:
    """Turn each update's validation gradient ``v`` into a look-ahead direction ``u`` (see the module docstring).

    Args:
        horizon: updates the look-ahead spans (``rho = 1 - 1/horizon``); 1 returns ``v`` unchanged.
        step: ``alpha_t * lambda_t``, the Neumann step relative to the largest curvature (in (0, 2)).

    Call ``lookahead(model, v, image, label, loss_fn)`` once per update with the training batch (at the same
    parameters as ``v``); ``state_dict`` / ``load_state_dict`` carry ``u`` and the power-iteration vector for an
    exact resume. After a call, ``gradient`` holds the training batch's mean-loss gradient at those parameters (the
    base of the finite differences; ``None`` with ``horizon`` 1), for a caller that needs it too.
    """

    def __init__(self, horizon: float, step: float = 0.5) -> None:
        if float(horizon) < 1:
            raise ValueError(f"lookahead horizon must be >= 1 update, got {horizon}")
        if not 0.0 < float(step) < 2.0:
            raise ValueError(f"lookahead step must be in (0, 2) (times 1/largest curvature), got {step}")
        self.horizon, self.step = float(horizon), float(step)
        self.rho = 1.0 - 1.0 / self.horizon
        self.u: Vector | None = None
        self.w: Vector | None = None  # power-iteration vector of the largest curvature
        self.curvature = float("nan")  # lambda_t of the last update
        self.alpha = float("nan")
        self.gradient: Vector | None = None  # the training batch's gradient at the last call's parameters

    def __call__(
        self,
        model: nn.Module,
        v: Mapping[str, torch.Tensor],
        image: torch.Tensor,
        label: torch.Tensor,
        loss_fn: PerSampleLoss,
    ) -> Vector:
        v = dict(v)
        self.gradient = None
        if self.rho == 0.0:
            return v
        if self.u is None or self.u.keys() != v.keys():
            self.u, self.w = None, _unit(v)
        elif not float(flat_norm(self.w)) > 0:  # started from a zero v: nothing for the power iteration to iterate
            self.w = _unit(v)
        vectors = [self.w] + ([self.u] if self.u is not None else [])
        products, self.gradient = _finite_difference_products(
            model, trainable_parameters(model), image, label, loss_fn, vectors
        )
        hw = products[0]
        curvature = float(flat_norm(hw))
        if not math.isfinite(curvature):
            raise FloatingPointError("non-finite Hessian-vector product in the look-ahead")
        if curvature > 0:
            self.w = _unit(hw)
            self.curvature = curvature
        if self.u is None or not self.curvature > 0:
            u = v
        else:
            self.alpha = self.step / self.curvature
            hu = products[1]
            u = {k: v[k] + self.rho * (self.u[k] - self.alpha * hu[k]) for k in v}
            if not all(bool(torch.isfinite(t).all()) for t in u.values()):
                raise FloatingPointError("non-finite look-ahead direction (Hessian-vector product)")
        self.u = {k: t.detach() for k, t in u.items()}
        return u

    def state_dict(self) -> dict:
        cpu = _to(torch.device("cpu"))
        return {"u": cpu(self.u), "w": cpu(self.w), "curvature": self.curvature}

    def load_state_dict(self, state: Mapping, device: torch.device | str = "cpu") -> None:
        move = _to(torch.device(device))
        self.u, self.w = move(state.get("u")), move(state.get("w"))
        self.curvature = float(state.get("curvature", float("nan")))


def _unit(x: Mapping[str, torch.Tensor]) -> Vector:
    norm = float(flat_norm(x))
    return {k: (t / norm if norm > 0 else t).detach().clone() for k, t in x.items()}


def _to(device: torch.device) -> Callable[[Mapping | None], Vector | None]:
    return lambda x: None if x is None else {k: t.to(device) for k, t in x.items()}
