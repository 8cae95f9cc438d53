"""The model step's gradient-norm clip (jcsaug.engine.GradientClipping) and where the dataset bundles use it."""

from __future__ import annotations

import pytest
import torch
from ignite.engine import Engine
from monai.bundle import ConfigParser
from monai.engines import SupervisedTrainer

from helpers import bundle_parser
from jcsaug.engine import GradientClipping
from jcsaug.networks import get_network, list_networks


def _one_step(max_norm: float | None) -> tuple[float, float, Engine]:
    """(norm of the parameter step, gradient norm before clipping, trainer) after one SGD step (lr 1, no momentum)
    on a loss whose gradient is far larger than 1."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    before = torch.cat([p.detach().flatten().clone() for p in net.parameters()])
    data = [{"image": torch.randn(8, 4) * 100, "label": torch.zeros(8, 1)}]
    trainer = SupervisedTrainer(
        device=torch.device("cpu"), max_epochs=1, train_data_loader=data, network=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=1.0), loss_function=torch.nn.MSELoss(),
        train_handlers=[GradientClipping(max_norm)],
    )  # fmt: skip
    trainer.run()
    after = torch.cat([p.detach().flatten() for p in net.parameters()])
    return float((after - before).norm()), getattr(trainer.state, "grad_norm", float("nan")), trainer


def test_the_step_is_clipped_to_max_norm_and_the_norm_before_is_kept():
    step, norm_before, _ = _one_step(0.5)
    assert norm_before > 10  # the unclipped gradient
    assert step == pytest.approx(0.5, rel=1e-5)  # SGD at lr 1: the step is the clipped gradient
    unclipped, _, trainer = _one_step(None)  # no clip: the whole gradient, nothing recorded
    assert unclipped == pytest.approx(norm_before, rel=1e-4) and not hasattr(trainer.state, "grad_norm")


def test_bad_max_norm_and_an_engine_without_the_backward_event_are_named():
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="max_norm"):
            GradientClipping(bad)
    with pytest.raises(TypeError, match="BACKWARD_COMPLETED"):
        GradientClipping(1.0).attach(Engine(lambda engine, batch: None))


@pytest.mark.parametrize("network", list_networks())
def test_the_dataset_bundles_clip_the_u_nets_at_12_and_not_deepmedic(network):
    """The reference's U-Net step clips the gradient norm at 12 (nnU-Net's); its DeepMedic step does not."""
    expected = None if network == "deepmedic" else 12.0
    assert get_network(network).grad_clip_norm == expected
    parser: ConfigParser = bundle_parser("kits19_tumor", network=network)
    handlers = parser["train_handlers"]
    (index,) = [i for i, h in enumerate(handlers) if isinstance(h, dict) and h["_target_"].endswith("GradientClipping")]
    assert parser.get_parsed_content(f"train_handlers#{index}").max_norm == expected


@pytest.mark.parametrize("meta_mode", ["eval", "train"])
def test_the_dataset_bundles_tra_meta_mode_reaches_the_tra_updater(meta_mode):
    """``tra_meta_mode: train`` runs the TRA's extra passes as the reference's code does (a U-Net's heads scored as
    trained); the bundles pass it to the updater."""
    from jcsaug.engine import AugmentationSetup

    net = torch.nn.Conv3d(1, 2, 1)
    updaters = AugmentationSetup("class-specific", "none").updaters(
        net, torch.optim.SGD(net.parameters(), lr=0.1), [], tra_meta_mode=meta_mode
    )
    assert updaters.tra.meta_mode == meta_mode
    assert "tra_meta_mode=@tra_meta_mode" in "".join(bundle_parser("kits19_tumor")["policy_updaters"].split())
