"""The policy handlers in your own Ignite loop (no MONAI trainer): joint class-specific TRA + TEA.

Your training step stays yours; ``TRAPolicyUpdater`` and ``TEAPolicyUpdater`` attach to the engine
and learn the policies every N iterations; ``PolicyExporter`` writes ``policies.json``. Offline, CPU:

    python examples/custom_ignite_loop.py --iterations 20 --output-dir runs/custom_loop
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import torch
from ignite.engine import Engine
from ignite.handlers import ProgressBar
from monai.data import CacheDataset, DataLoader, load_decathlon_datalist
from monai.losses import DiceCELoss
from monai.networks.nets import UNet
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandCropByPosNegLabeld
from monai.utils import set_determinism
from torch.utils.data import RandomSampler

from jcsaug.data import ContextCropd, make_synthetic_dataset
from jcsaug.engine import PolicyExporter, TEAPolicyUpdater, TRAPolicyUpdater
from jcsaug.ops import tra_context
from jcsaug.policy import (
    ClassGroupd,
    PolicySnapshotDataset,
    PolicySnapshotSampler,
    TRACascaded,
    make_tea_policy,
    make_tra_policy,
)


def main(iterations: int = 20, output_dir: str | None = None, data_dir: str | None = None) -> str:
    set_determinism(seed=0)
    data_dir = data_dir or tempfile.mkdtemp(prefix="jcsaug_example_")
    output_dir = output_dir or tempfile.mkdtemp(prefix="jcsaug_run_")
    datalist = make_synthetic_dataset(data_dir, num_train=6, num_val=2, num_test=1, shape=(32, 32, 32))
    files = {
        k: load_decathlon_datalist(datalist, data_list_key=k, base_dir=data_dir) for k in ("training", "validation")
    }

    tra_policy = make_tra_policy("nnunet", num_groups=2)  # background / foreground patches
    tea_policy = make_tea_policy("nnunet")
    load = [LoadImaged(["image", "label"], image_only=True), EnsureChannelFirstd(["image", "label"])]
    crop = RandCropByPosNegLabeld(["image", "label"], "label", spatial_size=(24, 24, 24), num_samples=4)
    # training patches with a context around them, which the TRA's rotations and zooms read before it returns them
    context = tra_context((24, 24, 24))
    augment = [ClassGroupd("label"), TRACascaded("image", tra_policy, label_keys="label", context=context)]
    train_pipeline = Compose([*load, ContextCropd(crop, context), *augment])
    train_dataset = CacheDataset(files["training"], train_pipeline, progress=False)
    # the workers draw from the TRA policy as it was when each index was dispatched, not when they get to it: the
    # run repeats with the same seed however busy the machine is
    train_loader = DataLoader(
        PolicySnapshotDataset(train_dataset, tra_policy),
        sampler=PolicySnapshotSampler(RandomSampler(train_dataset), tra_policy),  # shuffled, as shuffle=True
        batch_size=2, num_workers=2,
    )  # fmt: skip
    val_loader = DataLoader(CacheDataset(files["validation"], Compose(load + [crop]), progress=False), batch_size=2)

    net = UNet(3, 1, 2, channels=(8, 16), strides=(2,), num_res_units=1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)

    def train_step(engine: Engine, batch: dict) -> float:  # your own step
        net.train()
        optimizer.zero_grad()
        loss = loss_fn(net(batch["image"]), batch["label"])
        loss.backward()
        optimizer.step()
        return loss.item()

    trainer = Engine(train_step)
    TRAPolicyUpdater(tra_policy, net, val_loader, optimizer, lr=0.02, update_every=2, tea_policy=tea_policy).attach(
        trainer
    )
    TEAPolicyUpdater(tea_policy, net, val_loader, lr=0.01, update_every=2, num_copies=4).attach(trainer)
    exporter = PolicyExporter(output_dir, tra_policy, tea_policy)
    exporter.attach(trainer)
    ProgressBar(persist=True).attach(trainer, output_transform=lambda loss: {"loss": loss})
    trainer.run(train_loader, max_epochs=1, epoch_length=iterations)
    print(f"policies written to {exporter.policies_path}; show them with: jcsaug policy show {exporter.policies_path}")
    return str(exporter.policies_path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    # the updaters log a line per epoch (updates done, the ops that moved most) at INFO on the "jcsaug" logger
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("ignite").setLevel(logging.WARNING)
    main(args.iterations, args.output_dir, args.data_dir)
