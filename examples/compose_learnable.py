"""Make your own MONAI transforms learnable inside an existing pipeline, and learn their probabilities.

Two series of ordinary MONAI dictionary transforms become learnable choosers (index 0 = do nothing);
``TRAPolicyUpdater`` learns their probabilities on MONAI's ``SupervisedTrainer`` by the bi-level
update of the paper. The batches are made on a thread ahead of the loop, as MONAI's ``ThreadDataLoader`` makes
them, in lockstep with the policy updates (``LockstepThreadDataLoader``), so the run repeats with its seed.
Runs offline on the CPU in about a minute:

    python examples/compose_learnable.py --iterations 40
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from monai.data import CacheDataset, DataLoader, load_decathlon_datalist
from monai.engines import SupervisedTrainer
from monai.losses import DiceCELoss
from monai.networks.nets import UNet
from monai.transforms import (
    AdjustContrastd,
    Compose,
    EnsureChannelFirstd,
    Flipd,
    LoadImaged,
    RandCropByPosNegLabeld,
    Rotate90d,
    ScaleIntensityd,
)
from monai.utils import set_determinism

from jcsaug.data import make_synthetic_dataset
from jcsaug.engine import TRAPolicyUpdater
from jcsaug.policy import CategoricalPolicy, LearnableOneOfd, LockstepThreadDataLoader, PolicyHistory


def main(iterations: int = 40, data_dir: str | None = None) -> CategoricalPolicy:
    set_determinism(seed=0)
    data_dir = data_dir or tempfile.mkdtemp(prefix="jcsaug_example_")
    datalist = make_synthetic_dataset(data_dir, num_train=6, num_val=2, num_test=1, shape=(32, 32, 32))
    train_files = load_decathlon_datalist(datalist, data_list_key="training", base_dir=data_dir)
    val_files = load_decathlon_datalist(datalist, data_list_key="validation", base_dir=data_dir)

    # your own transform lists: one learnable series each (+ an implicit identity at index 0)
    spatial = [Flipd(["image", "label"], spatial_axis=0), Rotate90d(["image", "label"], spatial_axes=(0, 2))]
    intensity = [AdjustContrastd("image", gamma=1.5), AdjustContrastd("image", gamma=0.7), ScaleIntensityd("image")]
    policy = CategoricalPolicy(
        [len(spatial) + 1, len(intensity) + 1],
        series_names=["spatial", "intensity"],
        op_names=[["identity", "flip", "rot90"], ["identity", "gamma 1.5", "gamma 0.7", "rescale"]],
    )

    load = [LoadImaged(["image", "label"], image_only=True), EnsureChannelFirstd(["image", "label"])]
    crop = RandCropByPosNegLabeld(["image", "label"], "label", spatial_size=(24, 24, 24), num_samples=2)
    train_ds = CacheDataset(
        train_files,
        Compose(
            load
            + [
                crop,
                LearnableOneOfd(spatial, policy, 0, group_key=None),
                LearnableOneOfd(intensity, policy, 1, group_key=None),
            ]
        ),  # fmt: skip
        progress=False,
    )
    val_ds = CacheDataset(val_files, Compose(load + [crop]), progress=False)

    net = UNet(3, 1, 2, channels=(8, 16), strides=(2,), num_res_units=1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    updater = TRAPolicyUpdater(
        policy, net, DataLoader(val_ds, batch_size=2, shuffle=True), optimizer,
        lr=0.05, op_key="learnable_ops", val_loss="dice", train_loss="ce+dice",
    )  # fmt: skip
    # MONAI's ThreadDataLoader, each batch drawn from the policy as it was 2 iterations before it is trained on
    history = PolicyHistory(policy)
    trainer = SupervisedTrainer(
        device=torch.device("cpu"), max_epochs=1, epoch_length=iterations,
        train_data_loader=LockstepThreadDataLoader(train_ds, history, batch_size=2, shuffle=True),
        network=net, optimizer=optimizer, loss_function=DiceCELoss(to_onehot_y=True, softmax=True),
        train_handlers=[updater, history],
    )  # fmt: skip
    trainer.run()
    for name, ops, probs in zip(policy.series_names, policy.op_names, policy.probabilities()):
        print(name, {op: round(float(p), 3) for op, p in zip(ops, probs[0])})
    return policy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    main(args.iterations, args.data_dir)
