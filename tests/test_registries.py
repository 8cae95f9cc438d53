"""One registry pattern: every name-chosen thing has register_*, get_* and list_*, and one error text that lists the
valid names; each registered entry is exercised (parametrised over the list_* functions)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from jcsaug.cli import COMMANDS
from jcsaug.engine import get_hypergradient, get_loss, list_hypergradients, list_losses, register_hypergradient
from jcsaug.engine.hypergradient import HYPERGRADIENTS
from jcsaug.engine.losses import chunked_loss
from jcsaug.policy import (
    get_tea_preset,
    get_tra_preset,
    list_tea_presets,
    list_tra_presets,
    make_tea_policy,
    make_tra_policy,
)
from jcsaug.registry import Registry, UnknownNameError
from jcsaug.tasks import get_task, list_tasks


def _lookups():
    """(get_*, list_*) of every registry."""
    from jcsaug.engine import get_tea_mode, get_tra_mode, list_tea_modes, list_tra_modes
    from jcsaug.inference import get_tta_inferer, list_tta_inferers
    from jcsaug.networks import get_network, list_networks
    from jcsaug.ops.intensity import INTENSITY_KINDS
    from jcsaug.ops.tra import PARAM_SAMPLERS

    return {
        "network": (get_network, list_networks),
        "loss": (get_loss, list_losses),
        "hypergradient estimator": (get_hypergradient, list_hypergradients),
        "test-time augmentation": (get_tta_inferer, list_tta_inferers),
        "TRA preset": (get_tra_preset, list_tra_presets),
        "TEA preset": (get_tea_preset, list_tea_presets),
        "task": (get_task, list_tasks),
        "tra_mode": (get_tra_mode, list_tra_modes),
        "tea_mode": (get_tea_mode, list_tea_modes),
        "command": (COMMANDS.get, COMMANDS.names),
        "intensity kind": (INTENSITY_KINDS.get, INTENSITY_KINDS.names),
        "TRA op kind": (PARAM_SAMPLERS.get, PARAM_SAMPLERS.names),
    }


@pytest.mark.parametrize("kind", list(_lookups()))
def test_one_error_text_lists_the_valid_names(kind):
    get, names = _lookups()[kind]
    assert names() == sorted(names()) and names()
    for name in names():
        get(name)
    with pytest.raises(UnknownNameError) as caught:
        get("no-such-name")
    assert str(caught.value) == f"unknown {kind} 'no-such-name'; valid names: {', '.join(names())}"
    assert isinstance(caught.value, KeyError)


def test_registry_register_decorator_and_overwrite():
    registry: Registry[int] = Registry("number", {"one": 1})
    with pytest.raises(ValueError, match="'one' is already registered"):
        registry.register("one", 11)
    registry.register("one", 11, overwrite=True)

    @registry.register("two")
    def two():
        return 2

    assert registry.get("two") is two and "two" in registry and "three" not in registry and len(registry) == 2


@pytest.mark.parametrize("name", list_losses())
def test_every_loss_gives_one_finite_value_per_sample(name):
    logits = torch.randn(3, 2, 6, 6, 6)
    label = (torch.rand(3, 1, 6, 6, 6) > 0.5).float()
    values = get_loss(name)(logits, label)
    assert values.shape == (3,) and torch.isfinite(values).all()


def _gradient_norms(net, image, label) -> torch.Tensor:
    """Each sample's training-gradient length, by one backward pass per sample."""
    out = []
    for i in range(len(image)):
        grads = torch.autograd.grad(get_loss("ce")(net(image[i : i + 1]), label[i : i + 1]).sum(), net.parameters())
        out.append(torch.sqrt(sum((g**2).sum() for g in grads)))
    return torch.stack(out)


#: what each estimator estimates, from the exact ``dL_val/dw_i`` (a new estimator must say it here)
ESTIMATES = {
    "finite-difference": lambda exact, norms: exact,
    "jvp": lambda exact, norms: exact,
    "equal-norm": lambda exact, norms: exact * norms.mean() / norms,  # every gradient at the batch's mean length
}


@pytest.mark.parametrize("name", list_hypergradients())
def test_every_hypergradient_estimator_agrees_with_the_exact_one(name):
    torch.manual_seed(0)
    net = torch.nn.Conv3d(1, 2, 3, padding=1).double()
    theta = {n: p.detach().clone() for n, p in net.named_parameters()}
    v = {n: torch.randn_like(p) for n, p in theta.items()}
    image, label = torch.randn(4, 1, 6, 6, 6).double(), (torch.rand(4, 1, 6, 6, 6) > 0.5).double()
    exact = get_hypergradient("jvp")(net, theta, v, image, label, get_loss("ce"), 0.1)
    estimate = get_hypergradient(name)(net, theta, v, image, label, get_loss("ce"), 0.1)
    assert estimate.shape == (4,)
    expected = ESTIMATES[name](exact, _gradient_norms(net, image, label).detach())
    torch.testing.assert_close(estimate, expected, rtol=1e-3, atol=1e-7)


def test_a_registered_hypergradient_estimator_is_used_by_the_updater():
    from helpers import lesion_batch, tiny_unet
    from jcsaug.engine import TRAPolicyUpdater

    calls = []

    def zero(model, theta, v, image, label, loss_fn, lr, v_norm=None):
        calls.append(image.shape[0])
        return torch.zeros(image.shape[0], dtype=torch.float64)

    register_hypergradient("zero-test", zero)
    try:
        net = tiny_unet()
        updater = TRAPolicyUpdater(make_tra_policy(), net, [lesion_batch()], torch.optim.SGD(net.parameters(), 0.1),
                                   hypergradient="zero-test")  # fmt: skip
        assert updater.hypergradient is zero
    finally:
        HYPERGRADIENTS._entries.pop("zero-test")
    with pytest.raises(KeyError, match="unknown hypergradient estimator 'zero-test'"):
        TRAPolicyUpdater(make_tra_policy(), net, None, torch.optim.SGD(net.parameters()), hypergradient="zero-test")


@pytest.mark.parametrize("name", list_tra_presets())
def test_every_tra_preset_gives_probabilities(name):
    policy = make_tra_policy(name, num_groups=2)
    for probs in policy.probabilities():
        np.testing.assert_allclose(probs.sum(-1).numpy(), 1.0, rtol=1e-5)


@pytest.mark.parametrize("name", list_tea_presets())
def test_every_tea_preset_gives_probabilities(name):
    probs = make_tea_policy(name).probabilities()[0]
    assert probs.shape == (1, 84) and abs(float(probs.sum()) - 1) < 1e-5


@pytest.mark.parametrize("name", list_tasks())
def test_every_task_carries_its_bundle_facts(name):
    from jcsaug.networks import get_network

    spec = get_task(name)
    assert spec.name == name and spec.num_classes >= 2 and spec.max_epochs >= 1
    assert all(s > 0 for s in spec.planning_spacing)
    for network, fractions in spec.paper_settings.items():
        get_network(network)
        for fraction, (val_loss, beta) in fractions.items():
            chunked_loss(val_loss)  # a validation loss by name, per-sample or over the batch
            assert val_loss in {"ce", "batch-dice", "ce+batch-dice"}, (name, network, val_loss)  # the reference's
            assert spec.paper_setting(network, fraction) == (val_loss, beta) and beta > 0


@pytest.mark.parametrize("name", COMMANDS.names())
def test_every_command_builds_its_arguments(name):
    build, run = COMMANDS.get(name)
    build(argparse.ArgumentParser())
    assert callable(run)


def _tea_intensity_ops():
    from jcsaug.ops.tea import TEA_OPS

    return [op for op in TEA_OPS if not op.is_spatial and op.kind != "identity"]


@pytest.mark.parametrize("op", _tea_intensity_ops(), ids=lambda op: op.name)
def test_one_table_of_intensity_kinds_serves_both_catalogues(op):
    """A TEA intensity op and the TRA cascade with the same value give the same image: one implementation."""
    from jcsaug.ops.intensity import INTENSITY_KINDS
    from jcsaug.ops.tea import NOISE_SEED_BASE, apply_tea_ops
    from jcsaug.ops.tra import INTENSITY_FIELDS, TRA_SERIES, TRAParams, apply_tra_batch

    assert {o.kind for s in TRA_SERIES for o in s.ops if o.kind in INTENSITY_KINDS} == set(INTENSITY_KINDS)
    assert set(INTENSITY_FIELDS) == set(INTENSITY_KINDS)
    params = TRAParams(**{INTENSITY_FIELDS[op.kind]: op.value}, noise_seed=NOISE_SEED_BASE + op.id)
    image = torch.rand(1, 1, 12, 12, 12)
    tra = apply_tra_batch({"image": image}, {}, [params])[0]["image"]
    torch.testing.assert_close(tra, apply_tea_ops([op], image)[0][None], rtol=0, atol=0)


def test_a_normalising_registry_finds_every_name_it_lists():
    """A name registered in another spelling than its normalised form (``SwinUNETR`` in a case-insensitive registry)
    is found under every spelling, listed as registered, and a second spelling of a taken name is refused."""
    registry: Registry[int] = Registry("network", normalise=str.lower)
    registry.register("SwinUNETR", 1)
    assert registry.names() == list(registry) == ["SwinUNETR"] and registry.items() == [("SwinUNETR", 1)]
    for spelling in ("SwinUNETR", "swinunetr", "SWINUNETR"):
        assert registry.get(spelling) == 1 and spelling in registry and registry.key(spelling) == "SwinUNETR"
    with pytest.raises(ValueError, match=r"'swinunetr' is already registered \(as 'SwinUNETR', the same name once"):
        registry.register("swinunetr", 2)
    registry.register("swinunetr", 2, overwrite=True)
    assert registry.get("SwinUNETR") == 2 and len(registry) == 1 and registry.names() == ["swinunetr"]
    with pytest.raises(ValueError, match="non-empty string"):
        Registry("loss", normalise=lambda name: name.strip()).register("  ", 3)  # nothing left once normalised


def test_the_loss_and_network_registries_find_names_registered_in_capitals():
    """The reviewer's case: ``get_loss('focal_DSC')`` said the valid names were ``..., focal_DSC``."""
    from jcsaug.engine.losses import LOSSES, _loss_key
    from jcsaug.engine.preflight import check_settings
    from jcsaug.networks import NETWORKS, NetworkSpec, get_network, register_network

    def focal(logits, label):
        return torch.zeros(len(logits))

    spec = NetworkSpec("SwinUNETR", lambda *args, **kwargs: None)
    LOSSES.register("focal_DSC", focal)
    register_network(spec)
    try:
        assert get_loss("focal_DSC") is get_loss("Focal_dice") is focal and "focal_DSC" in list_losses()
        assert get_network("SwinUNETR") is get_network("swinunetr") is spec and "SwinUNETR" in NETWORKS
        check_settings(argv=[], network="SwinUNETR", train_loss="focal_DSC", val_loss="FOCAL_DSC")
        with pytest.raises(ValueError, match=r"loss 'CE' is already registered \(as 'ce'"):
            LOSSES.register("CE", focal)  # would have shadowed 'ce' for some spellings only
    finally:
        LOSSES._entries.pop(_loss_key("focal_DSC"))
        NETWORKS._entries.pop("swinunetr")
    assert "focal_DSC" not in list_losses() and "SwinUNETR" not in NETWORKS
