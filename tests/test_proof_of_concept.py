"""The paper's supplementary proof of concept: deliberately bad ops are learned away, by TRA and by TEA.

Bad ops (x², x⁴, 0.01·x, −0.01·x, x+300) are added to a learnable series with uniform initial
probabilities; a short seeded training on synthetic lesions must drive their total probability
clearly below its initial value.
"""

from __future__ import annotations

import itertools

import torch
from monai.data import MetaTensor, list_data_collate
from monai.transforms import Flipd, Lambdad
from monai.utils import set_determinism

from helpers import lesion_batch, tiny_unet, train_engine
from jcsaug.engine import TEAPolicyUpdater, TRAPolicyUpdater
from jcsaug.policy import CategoricalPolicy, LearnableOneOfd

BAD = {
    "square": lambda x: x**2,
    "fourth power": lambda x: x**4,
    "times 0.01": lambda x: 0.01 * x,
    "times -0.01": lambda x: -0.01 * x,
    "plus 300": lambda x: x + 300,
}
NUM_GOOD = 3  # identity + two mirrors


def _bad_mass(policy: CategoricalPolicy) -> float:
    return float(policy.probabilities()[0][0, NUM_GOOD:].sum())


def test_tra_learns_to_avoid_bad_ops():
    set_determinism(seed=0)
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    transforms = [Flipd(["image", "label"], spatial_axis=0), Flipd(["image", "label"], spatial_axis=1)]
    transforms += [Lambdad("image", fn) for fn in BAD.values()]
    policy = CategoricalPolicy([len(transforms) + 1])  # uniform
    chooser = LearnableOneOfd(transforms, policy, group_key=None, op_key="ops").set_random_state(0)
    initial = _bad_mass(policy)

    def batches():
        for i in itertools.count():
            raw = lesion_batch(8, seed=i)
            samples = [{k: MetaTensor(raw[k][j]) for k in ("image", "label")} for j in range(8)]
            yield list_data_collate([chooser(s) for s in samples])

    val = [lesion_batch(8, seed=10_000 + i) for i in range(4)]
    updater = TRAPolicyUpdater(policy, net, val, opt, lr=0.2, op_key="ops", val_loss="ce", seed=0)
    engine = train_engine(net, opt)
    updater.attach(engine)
    engine.run(batches(), max_epochs=1, epoch_length=60)
    set_determinism(None)
    assert updater.updates == 60
    assert _bad_mass(policy) < 0.6 * initial, policy.probabilities()[0]


class _IntensityOp:
    """A TEA-like op: changes the image, nothing to map back."""

    def __init__(self, fn):
        self.fn = fn

    def transform_image(self, img):
        return self.fn(img)

    def invert(self, pred):
        return pred


class _FlipOp:
    def __init__(self, axis: int):
        self.dims = [axis + 1]

    def transform_image(self, img):
        return torch.flip(img, self.dims)

    def invert(self, pred):
        return torch.flip(pred, self.dims)


def test_tea_learns_to_avoid_bad_ops():
    set_determinism(seed=0)
    net = tiny_unet()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    engine = train_engine(net, opt)
    engine.run([lesion_batch(8, seed=i) for i in range(40)], max_epochs=1)  # a usable segmenter first

    ops = [_IntensityOp(lambda x: x), _FlipOp(0), _FlipOp(1)] + [_IntensityOp(fn) for fn in BAD.values()]
    policy = CategoricalPolicy([len(ops)])
    initial = _bad_mass(policy)
    val = [lesion_batch(4, seed=20_000 + i) for i in range(4)]
    updater = TEAPolicyUpdater(policy, net, val, lr=0.2, num_copies=10, ops=ops, seed=0)
    frozen = train_engine(net, opt, train=False)
    updater.attach(frozen)
    frozen.run([None] * 40, max_epochs=1)
    set_determinism(None)
    assert updater.updates == 40
    assert _bad_mass(policy) < 0.6 * initial, policy.probabilities()[0]
