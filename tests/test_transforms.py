"""Policy-driven MONAI dictionary transforms inside real MONAI pipelines."""

import numpy as np
import pytest
import torch
from monai.data import CacheDataset, DataLoader, Dataset, MetaTensor
from monai.transforms import Compose, Flipd, RandGaussianNoised, ScaleIntensityd
from monai.utils import set_determinism

from jcsaug.policy import CategoricalPolicy, ClassGroupd, LearnableOneOfd, TRACascaded, make_tra_policy


def _sample(fg_centre: bool, size: int = 12) -> dict:
    lab = torch.zeros(1, size, size, size)
    if fg_centre:
        lab[0, size // 2 - 2 : size // 2 + 2, size // 2 - 2 : size // 2 + 2, size // 2 - 2 : size // 2 + 2] = 2
    img = MetaTensor(torch.rand(1, size, size, size), affine=torch.eye(4))
    return {"image": img, "label": MetaTensor(lab, affine=torch.eye(4))}


def test_class_group_default_and_custom_mapping():
    assert ClassGroupd("label")(_sample(True))["class_group"] == 1
    assert ClassGroupd("label")(_sample(False))["class_group"] == 0
    mapped = ClassGroupd("label", mapping={0: 0, 1: 1, 2: 2}, num_groups=3)(_sample(True))
    assert mapped["class_group"] == 2
    with pytest.raises(ValueError, match=r"label value 2 at the patch centre is not in the class-group mapping"):
        ClassGroupd("label", mapping={0: 0, 1: 1})(_sample(True))
    with pytest.raises(ValueError, match=r"out of range \[0, 2\)"):
        ClassGroupd("label", mapping={0: 0, 1: 2}, num_groups=2)


def test_class_group_reads_one_hot_labels():
    lab = torch.zeros(3, 5, 5, 5)
    lab[0] = 1
    lab[:, 2, 2, 2] = torch.tensor([0.0, 0.0, 1.0])
    assert ClassGroupd("label", mapping={0: 0, 1: 1, 2: 1})({"label": lab})["class_group"] == 1


def test_cascade_records_choices_and_keeps_caller_metadata():
    policy = make_tra_policy("uniform", num_groups=2)
    pipeline = Compose([ClassGroupd("label"), TRACascaded("image", policy, label_keys="label")])
    pipeline.set_random_state(0)
    data = _sample(True)
    before = (list(data["image"].applied_operations), list(data["label"].applied_operations))
    out = pipeline(data)
    assert out["tra_ops"].shape == (15,) and out["tra_ops"].dtype == torch.long
    assert isinstance(out["image"], MetaTensor) and isinstance(out["label"], MetaTensor)
    assert (list(data["image"].applied_operations), list(data["label"].applied_operations)) == before
    assert set(out["label"].unique().tolist()) <= {0, 2}


def test_learnable_one_of_wraps_any_monai_transforms_without_stale_entries():
    policy = CategoricalPolicy([4], init_probs=[[0.0, 0.0, 1.0, 0.0]])  # always the 2nd transform (Flipd)
    chooser = LearnableOneOfd(
        [ScaleIntensityd("image"), Flipd(["image", "label"], spatial_axis=0), RandGaussianNoised("image", prob=1.0)],
        policy,
        group_key=None,
    )
    chooser.set_random_state(0)
    data = _sample(True)
    out = chooser(data)
    assert out["learnable_ops"].tolist() == [2]
    assert torch.equal(out["image"].as_tensor(), torch.flip(data["image"].as_tensor(), dims=[1]))
    assert len(data["image"].applied_operations) == 0  # the caller's tensor is untouched (MONAI's OneOf is not)
    with pytest.raises(ValueError, match=r"has 4 choices but 2 transforms"):
        LearnableOneOfd([Flipd("image"), Flipd("image")], policy)


def test_learnable_one_of_frequencies_and_shared_op_key():
    policy = CategoricalPolicy([3, 2], num_groups=1, init_probs=[[0.2, 0.3, 0.5], [0.5, 0.5]])
    first = LearnableOneOfd([Flipd("image", 0), Flipd("image", 1)], policy, series=0, group_key=None)
    second = LearnableOneOfd([Flipd("image", 2)], policy, series=1, group_key=None)
    pipeline = Compose([first, second]).set_random_state(1)
    ops = np.stack([pipeline({"image": torch.rand(1, 4, 4, 4)})["learnable_ops"].numpy() for _ in range(3000)])
    freq = np.bincount(ops[:, 0], minlength=3) / len(ops)
    np.testing.assert_allclose(freq, [0.2, 0.3, 0.5], atol=0.03)
    assert set(ops[:, 1]) == {0, 1}


def _pipeline(policy):
    return Compose([ClassGroupd("label"), TRACascaded("image", policy, label_keys="label")])


def test_dataloader_workers_cache_dataset_and_collation():
    policy = make_tra_policy("nnunet", num_groups=2)
    data = [_sample(i % 2 == 0) for i in range(8)]
    ds = CacheDataset(data, transform=_pipeline(policy), cache_rate=1.0, progress=False)
    batch = next(iter(DataLoader(ds, batch_size=4, num_workers=2)))
    assert batch["tra_ops"].shape == (4, 15) and batch["tra_ops"].dtype == torch.long
    assert batch["class_group"].tolist() == [1, 0, 1, 0]
    assert batch["image"].shape == (4, 1, 12, 12, 12)


def test_policy_update_reaches_running_workers():
    policy = CategoricalPolicy([s for s in make_tra_policy().series_sizes], num_groups=2)
    policy.set_probabilities([np.eye(n)[0] for n in policy.series_sizes])  # identity only
    ds = Dataset([_sample(True) for _ in range(200)], transform=_pipeline(policy))
    loader = DataLoader(ds, batch_size=2, num_workers=1, prefetch_factor=1, persistent_workers=True)
    it = iter(loader)
    assert next(it)["tra_ops"].sum() == 0
    # main process: put all mass of mirror_sagittal (series 4) on the flip, in place (as an optimiser does)
    with torch.no_grad():
        policy.logits[:, policy.series_slice(4)] = torch.tensor([-30.0, 30.0])
    seen = [next(it)["tra_ops"][:, 4].tolist() for _ in range(6)]
    assert seen[-1] == [1, 1]  # a few batches of prefetch lag at most


def test_set_determinism_gives_same_choices():
    def run():
        set_determinism(seed=11)
        policy = make_tra_policy("uniform", num_groups=2)
        loader = DataLoader(
            Dataset([_sample(i % 3 == 0) for i in range(6)], transform=_pipeline(policy)), batch_size=3, num_workers=2
        )
        return torch.cat([b["tra_ops"] for b in loader])

    first, second = run(), run()
    set_determinism(None)
    assert torch.equal(first, second)
    assert first.unique().numel() > 2


def test_cascade_errors_name_the_problem():
    with pytest.raises(ValueError, match="needs a policy over the 15 TRA series"):
        TRACascaded("image", CategoricalPolicy([3]))
    cascade = TRACascaded("image", make_tra_policy("nnunet"), label_keys="label")
    with pytest.raises(KeyError, match="class group key 'class_group' missing"):
        cascade(_sample(True))
    flat = {"image": torch.rand(1, 8, 8), "label": torch.zeros(1, 8, 8), "class_group": 0}
    with pytest.raises(ValueError, match=r"key 'image' has shape \(1, 8, 8\)"):
        cascade(flat)
    no_label = {"image": torch.rand(1, 8, 8, 8), "class_group": 0}
    with pytest.raises(KeyError, match=r"label key\(s\) \['label'\] not in data"):
        cascade(no_label)
    # refused when built, not at the first sample that happens to draw an affine op
    with pytest.raises(ValueError, match="padding_mode must be one of .*'reflection'"):
        TRACascaded("image", make_tra_policy("nnunet"), padding_mode="reflection")
