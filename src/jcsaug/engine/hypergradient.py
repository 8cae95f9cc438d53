"""The maths of the TRA update (SPEC §4), free of any training loop.

With the trainer's step ``theta -> theta*`` done, and ``v = grad L_val(theta*)``:

* :func:`finite_difference_hypergradient` gives ``dL_val/dw_i`` from per-sample training losses at
  ``theta ± eps v`` (DARTS, two forward passes);
* :func:`jvp_hypergradient` gives the same quantity exactly with one forward-mode ``torch.func.jvp``;
* :func:`normalise_hypergradient` centres per class group and divides by the sampling frequency of
  each op per series, giving one coefficient per (sample, series).

Estimators are chosen by name (the updaters' ``hypergradient`` argument, the bundles' ``hypergradient`` id):
``register_hypergradient(name, fn)`` adds one with the signature of :func:`finite_difference_hypergradient`,
``get_hypergradient`` / ``list_hypergradients`` look them up.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.func import functional_call, jvp

from jcsaug.engine.losses import PerSampleLoss, main_output
from jcsaug.registry import Registry


def flat_norm(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Euclidean norm of a set of tensors taken as one vector (float64)."""
    return torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values()))


def call_with(model: nn.Module, tensors: Mapping[str, torch.Tensor], *args: torch.Tensor):
    """``torch.func.functional_call(model, tensors, args)``, then the model's own parameters and buffers put back.

    Why by hand: ``functional_call`` does not restore the parameters of modules reachable by two paths (MONAI's
    ``DynUNet`` reaches its encoder blocks through ``input_block``/``downsamples`` and through ``skip_layers``):
    they come back as the swapped-in plain tensors, so the network silently stops training (its optimiser keeps
    updating the original parameters, which the network no longer uses).
    """
    slots = [(store, key, value) for m in model.modules() for store in (m._parameters, m._buffers)
             for key, value in store.items()]  # fmt: skip
    try:
        return functional_call(model, dict(tensors), args)
    finally:
        for store, key, value in slots:
            store[key] = value


def losses_at(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    image: torch.Tensor,
    label: torch.Tensor,
    loss_fn: PerSampleLoss,
) -> torch.Tensor:
    """Per-sample training losses ``[n]`` of ``model`` evaluated at ``params`` (with ``buffers``)."""
    return loss_fn(main_output(call_with(model, {**params, **buffers}, image)), label)


def finite_difference_hypergradient(
    model: nn.Module,
    theta: Mapping[str, torch.Tensor],
    v: Mapping[str, torch.Tensor],
    image: torch.Tensor,
    label: torch.Tensor,
    loss_fn: PerSampleLoss,
    lr: float,
    r: float = 0.01,
    v_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """``g_i = -lr * (dL_train(theta+)/dw_i - dL_train(theta-)/dw_i) / (2 eps)``, ``eps = r / ||v||``.

    ``L_train = (1/n) sum_i w_i l_i`` so ``dL_train/dw_i = l_i / n``. Returns ``[n]`` (float64).
    ``v_norm`` may pass ``||v||`` when the caller has it already.
    """
    eps = r / (flat_norm(v) if v_norm is None else v_norm)
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        plus = {k: theta[k] + eps * v[k] for k in theta}
        minus = {k: theta[k] - eps * v[k] for k in theta}
        l_plus = losses_at(model, plus, buffers, image, label, loss_fn).double()
        l_minus = losses_at(model, minus, buffers, image, label, loss_fn).double()
    n = image.shape[0]
    return -lr * (l_plus - l_minus) / (2 * eps) / n


def jvp_hypergradient(
    model: nn.Module,
    theta: Mapping[str, torch.Tensor],
    v: Mapping[str, torch.Tensor],
    image: torch.Tensor,
    label: torch.Tensor,
    loss_fn: PerSampleLoss,
    lr: float,
    v_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact ``g_i = -lr/n * grad l_i(theta) . v`` by one forward-mode JVP. Returns ``[n]`` (float64).

    ``v_norm`` is accepted for a common signature with the finite difference and not needed.
    """
    buffers = dict(model.named_buffers())
    names = list(theta)

    def losses(*flat: torch.Tensor) -> torch.Tensor:
        return losses_at(model, dict(zip(names, flat)), buffers, image, label, loss_fn)

    with torch.no_grad():
        _, tangent = jvp(losses, tuple(theta[k] for k in names), tuple(v[k] for k in names))
    return -lr * tangent.double() / image.shape[0]


#: name -> estimator ``(model, theta, v, image, label, loss_fn, lr, v_norm=None) -> [n]`` of ``dL_val/dw_i``
HYPERGRADIENTS: Registry = Registry("hypergradient estimator")
HYPERGRADIENTS.register("finite-difference", finite_difference_hypergradient)
HYPERGRADIENTS.register("jvp", jvp_hypergradient)


#: ``register_hypergradient(name, estimator)`` (or ``@register_hypergradient(name)``), ``get_hypergradient(name)``,
#: ``list_hypergradients()``
register_hypergradient = HYPERGRADIENTS.register
get_hypergradient, list_hypergradients = HYPERGRADIENTS.get, HYPERGRADIENTS.names


def normalise_hypergradient(g: torch.Tensor, groups: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """Class centring and sampling normalisation (SPEC §4 steps 4-5).

    ``h_i = g_i - mean(g_j : c_j = c_i)``; ``ĥ_is = h_i / #{j : c_j = c_i, k_js = k_is}``.

    Args:
        g: ``[B]`` hypergradients ``dL_val/dw_i``.
        groups: ``[B]`` class groups.
        choices: ``[B, L]`` recorded op indices.

    Returns:
        ``[B, L]`` coefficients; the policy gradient is ``sum_is ĥ_is dw_is/dp``.
    """
    g = g.double()
    groups = groups.long().reshape(-1)
    h = torch.empty_like(g)
    for c in groups.unique():
        mask = groups == c
        h[mask] = g[mask] - g[mask].mean()
    same_group = groups[:, None] == groups[None, :]  # [B, B]
    same_op = choices[:, None, :] == choices[None, :, :]  # [B, B, L]
    counts = (same_group[:, :, None] & same_op).sum(1)  # [B, L], >= 1 (the sample itself)
    return h[:, None] / counts.double()
