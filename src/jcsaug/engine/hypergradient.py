"""The maths of the TRA update (SPEC §4), free of any training loop.

With the trainer's step ``theta -> theta*`` done, and ``v = grad L_val(theta*)``:

* :func:`finite_difference_hypergradient` gives ``dL_val/dw_i`` from per-sample training losses at
  ``theta ± eps v`` (DARTS, two forward passes);
* :func:`jvp_hypergradient` gives the same quantity exactly with one forward-mode ``torch.func.jvp``;
* :func:`equal_norm_hypergradient` (beyond the paper) scores each sample by the direction of its training gradient
  only, every gradient rescaled to the batch's mean length (one backward pass per sample);
* :func:`normalise_hypergradient` centres per class group and divides by the sampling frequency of
  each op per series, giving one coefficient per (sample, series).

Both estimators also work on a network in training mode (the updaters' ``meta_mode="train"``): the two passes of the
finite difference draw the same random numbers (dropout masks), and the network's buffers (BatchNorm running
statistics) are left as they were.

Estimators are chosen by name (the updaters' ``hypergradient`` argument, the bundles' ``hypergradient`` id):
``register_hypergradient(name, fn)`` adds one with the signature of :func:`finite_difference_hypergradient`,
``get_hypergradient`` / ``list_hypergradients`` look them up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.func import functional_call, jvp

from jcsaug.engine.losses import PerSampleLoss, per_sample_training_losses
from jcsaug.registry import Registry


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's parameters that require gradients, by name: what the hypergradients differentiate."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def flat_norm(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Euclidean norm of a set of tensors taken as one vector (float64)."""
    return torch.sqrt(sum((t.double() ** 2).sum() for t in tensors.values()))


def flat_dot(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``a . b`` of two sets of tensors (the same keys and shapes) taken as vectors (float64)."""
    return sum((a[k].double() * b[k].double()).sum() for k in a)


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


def pass_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers for one extra pass of ``model``: its own, or copies in training mode.

    Why copies: BatchNorm in training mode updates its running statistics (and ``num_batches_tracked``) in place,
    so an extra pass would change the network the trainer trains; and ``torch.func`` transforms refuse to mutate a
    tensor from outside. In eval mode nothing is written and the buffers are used as they are.
    """
    if not model.training:
        return dict(model.named_buffers())
    return {k: b.clone() for k, b in model.named_buffers()}


def rewind_randomness(device: torch.device) -> Callable[[], None]:
    """A function that puts the random generators a pass on ``device`` draws from back to their state now.

    Calling it between two passes makes them draw the same random numbers (the same dropout masks), so that their
    difference is the parameters' effect alone; the generators end as after one pass, and runs stay reproducible
    under ``set_determinism`` (no new seed is drawn).
    """
    cpu = torch.get_rng_state()
    module = None if device.type == "cpu" else getattr(torch, device.type, None)  # torch.cuda, torch.mps, ...
    accelerator = module.get_rng_state(device) if hasattr(module, "get_rng_state") else None

    def rewind() -> None:
        torch.set_rng_state(cpu)
        if accelerator is not None:
            module.set_rng_state(accelerator, device)

    return rewind


def losses_at(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    image: torch.Tensor,
    label: torch.Tensor,
    loss_fn: PerSampleLoss,
) -> torch.Tensor:
    """Per-sample training losses ``[n]`` of ``model`` evaluated at ``params`` (with ``buffers``); the heads of a
    deep-supervision output weighted as the model's training loss weights them (:func:`per_sample_training_losses`)."""
    return per_sample_training_losses(loss_fn, call_with(model, {**params, **buffers}, image), label)


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

    In training mode both passes see the same dropout masks (a difference of two independent draws would swamp the
    ``O(eps)`` signal) and run on copies of the buffers (BatchNorm running statistics stay as they were).
    """
    eps = r / (flat_norm(v) if v_norm is None else v_norm)
    with torch.no_grad():
        plus = {k: theta[k] + eps * v[k] for k in theta}
        minus = {k: theta[k] - eps * v[k] for k in theta}
        rewind = rewind_randomness(image.device)
        l_plus = losses_at(model, plus, pass_buffers(model), image, label, loss_fn).double()
        rewind()
        l_minus = losses_at(model, minus, pass_buffers(model), image, label, loss_fn).double()
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

    ``v_norm`` is accepted for a common signature with the finite difference and not needed. In training mode the
    buffers are copied inside the transformed function, where BatchNorm may update them (``torch.func`` refuses to
    mutate the network's own), and the network's stay as they were.
    """
    names = list(theta)

    def losses(*flat: torch.Tensor) -> torch.Tensor:  # the copies are made here, inside the transform
        return losses_at(model, dict(zip(names, flat)), pass_buffers(model), image, label, loss_fn)

    with torch.no_grad():
        _, tangent = jvp(losses, tuple(theta[k] for k in names), tuple(v[k] for k in names))
    return -lr * tangent.double() / image.shape[0]


def training_gradient(
    model: nn.Module, image: torch.Tensor, label: torch.Tensor, loss_fn: PerSampleLoss
) -> dict[str, torch.Tensor]:
    """The gradient of the batch's mean training loss with respect to the model's trainable parameters, at their
    present values (zeros for a parameter the loss does not reach)."""
    params = trainable_parameters(model)
    loss = per_sample_training_losses(loss_fn, model(image), label).mean()
    if not torch.isfinite(loss):
        raise FloatingPointError("non-finite training loss")
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: g if g is not None else torch.zeros_like(p) for (n, p), g in zip(params.items(), grads)}


def per_sample_gradient_stats(
    model: nn.Module,
    theta: Mapping[str, torch.Tensor],
    v: Mapping[str, torch.Tensor],
    image: torch.Tensor,
    label: torch.Tensor,
    loss_fn: PerSampleLoss,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad l_i(theta) . v, |grad l_i(theta)|)`` for every sample ``i`` of the batch (two ``[n]`` float64).

    One forward and backward pass per sample: a JVP or a finite difference gives a gradient's projections, not its
    length. Each sample is passed alone, so in training mode a BatchNorm network normalises it by its own
    statistics (in eval mode, the default of the updaters, the passes are exactly the batch's), with copies of the
    buffers as the other estimators.
    """
    names = list(theta)
    dots, norms = [], []
    with torch.enable_grad():
        for i in range(image.shape[0]):
            point = {k: theta[k].detach().requires_grad_() for k in names}
            loss = losses_at(model, point, pass_buffers(model), image[i : i + 1], label[i : i + 1], loss_fn).sum()
            grads = torch.autograd.grad(loss, [point[k] for k in names], allow_unused=True)
            grads = [torch.zeros_like(point[k]) if g is None else g for k, g in zip(names, grads)]
            grads = dict(zip(names, grads))
            dots.append(flat_dot(grads, v))
            norms.append(flat_norm(grads))
    return torch.stack(dots), torch.stack(norms)


def equal_norm_hypergradient(
    model: nn.Module,
    theta: Mapping[str, torch.Tensor],
    v: Mapping[str, torch.Tensor],
    image: torch.Tensor,
    label: torch.Tensor,
    loss_fn: PerSampleLoss,
    lr: float,
    v_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """``g_i = -lr/n * grad l_i . v * mean_j |grad l_j| / |grad l_i|``: the exact estimate (as
    :func:`jvp_hypergradient`) with every sample's training gradient rescaled to the batch's mean length.
    Returns ``[n]`` (float64).

    Beyond the paper: the one-step estimate grows with the length of a sample's gradient, so it credits an op for
    making harder patches (larger losses, larger gradients) whatever they teach (``bench_op_effects.py
    --gradient-ratio``: on a zoom shift the effects' rank correlation with the gradient ratio is +0.8). Here only
    the *direction* of each sample's gradient counts (its cosine with ``v``, on the batch's common scale). A sample
    whose gradient is zero scores 0. Costs one forward and backward pass per sample
    (:func:`per_sample_gradient_stats`) instead of two forward passes of the batch.
    """
    dots, norms = per_sample_gradient_stats(model, theta, v, image, label, loss_fn)
    scale = torch.where(norms > 0, norms.mean() / norms.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return -lr * dots * scale / image.shape[0]


#: name -> estimator ``(model, theta, v, image, label, loss_fn, lr, v_norm=None) -> [n]`` of ``dL_val/dw_i``
HYPERGRADIENTS: Registry = Registry("hypergradient estimator")
HYPERGRADIENTS.register("finite-difference", finite_difference_hypergradient)
HYPERGRADIENTS.register("jvp", jvp_hypergradient)
HYPERGRADIENTS.register("equal-norm", equal_norm_hypergradient)


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
