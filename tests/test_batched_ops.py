"""Batched TRA/TEA ops on whatever device the batch is on (tested on CPU tensors with an explicit device):
resampling, intensity ops and filters against the MONAI transforms they stand for, the batched cascade
against the per-sample one, identity exactness, one grid_sample per key, the TEA grid cache."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ignite.engine import Events
from monai.data import MetaTensor, list_data_collate
from monai.networks.layers import separable_filtering
from monai.transforms import AdjustContrast, Affine, GaussianSmooth, ScaleIntensityFixedMean
from monai.utils import set_determinism

from jcsaug.ops import filters, intensity, resample, tea
from jcsaug.ops.tea import TEA_OPS, apply_tea_ops, apply_tea_ops_by_shape, clear_grid_cache
from jcsaug.ops.tra import TRA_SERIES, TRAParams, affine_matrix, apply_tra, apply_tra_batch, sample_tra_params
from jcsaug.policy import BatchTRACascaded, ClassGroupd, TRACascaded, make_tra_policy

pytestmark = pytest.mark.usefixtures("single_thread")

DEVICE = torch.device("cpu")  # the code paths are device-agnostic; a CUDA machine can set this to "cuda"


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


# ---------------------------------------------------------------------------------------------- resampling
@pytest.mark.parametrize(
    "params",
    [
        TRAParams(scale=1.27),  # scaling only: factored (2D + 1D) on the CPU
        TRAParams(scale=0.83, angles=[0.31, 0.0, 0.0]),  # one rotation axis + scaling: factored
        TRAParams(angles=[0.0, -0.43, 0.0]),  # one rotation axis, no 1D pass
        TRAParams(scale=1.13, angles=[0.2, -0.1, 0.35]),  # general: one 3D grid_sample
    ],
)
def test_resampling_equals_monai_affine(params: TRAParams) -> None:
    img, lab = _rand(2, 12, 10, 14), (_rand(1, 12, 10, 14, seed=1) * 3).floor()
    oi, ol = apply_tra({"image": img}, {"label": lab}, params)
    for x, out, mode in ((img, oi["image"], "bilinear"), (lab, ol["label"], "nearest")):
        ref = Affine(rotate_params=params.angles, scale_params=[params.scale] * 3, mode=mode, padding_mode="zeros",
                     image_only=True)(x).as_tensor()  # fmt: skip
        if mode == "bilinear":
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        else:  # nearest: equal except possibly at exact ties (rounding of a coordinate at .5)
            assert (out != ref).float().mean() < 0.01


def test_factored_path_equals_one_3d_grid_sample() -> None:
    x = _rand(1, 2, 16, 13, 11)
    for params in (TRAParams(scale=1.37), TRAParams(scale=0.71, angles=[0.0, 0.0, 0.4])):
        m = affine_matrix(params)[None]
        assert resample.separable_axis(m[0]) is not None
        grid = resample.affine_grid(m, x.shape[2:], x.device)
        for padding in ("zeros", "border"):
            factored = resample.resample(x, m, "bilinear", padding)
            direct = F.grid_sample(x, grid, mode="bilinear", padding_mode=padding, align_corners=False)
            torch.testing.assert_close(factored, direct, atol=1e-5, rtol=1e-5)


def test_separable_axis_detection() -> None:
    assert resample.separable_axis(torch.eye(3)) == 0
    assert resample.separable_axis(affine_matrix(TRAParams(angles=[0.0, 0.3, 0.0]))) == 1
    assert resample.separable_axis(affine_matrix(TRAParams(angles=[0.1, 0.3, 0.0]))) is None


# ---------------------------------------------------------------------------------------------- intensity
def test_intensity_ops_equal_monai_per_sample() -> None:
    x = _rand(3, 2, 9, 10, 11) * 4 - 1
    values = [1.2, 0.8, 1.5]
    gamma, inverted = intensity.gamma(x, torch.tensor(values)), intensity.inverted_gamma(x, torch.tensor(values))
    contrast = intensity.contrast(x, torch.tensor(values))
    for i, v in enumerate(values):
        torch.testing.assert_close(gamma[i], AdjustContrast(v, retain_stats=True)(x[i]).as_tensor())
        inverted_monai = AdjustContrast(v, invert_image=True, retain_stats=True)(x[i]).as_tensor()
        torch.testing.assert_close(inverted[i], inverted_monai)
        torch.testing.assert_close(contrast[i], ScaleIntensityFixedMean(factor=v - 1.0)(x[i]).as_tensor())
    torch.testing.assert_close(intensity.shift(x, torch.tensor(values)), x + torch.tensor(values).view(3, 1, 1, 1, 1))
    plain = intensity.gamma(x, torch.tensor(values), retain_stats=False)
    for i, v in enumerate(values):
        torch.testing.assert_close(plain[i], AdjustContrast(v)(x[i]).as_tensor())


def test_gamma_keeps_each_samples_mean_and_std_and_bends_its_curve() -> None:
    """The reference code's and nnU-Net's gamma restore the image's mean and standard deviation: a gamma changes
    the shape of the intensity histogram, not the patch's brightness."""
    x = _rand(4, 1, 8, 8, 8) * 3 - 1
    for op in (intensity.gamma, intensity.inverted_gamma):
        out = op(x, torch.tensor([0.5, 0.8, 1.3, 2.0]))
        torch.testing.assert_close(out.mean((1, 2, 3, 4)), x.mean((1, 2, 3, 4)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.std((1, 2, 3, 4)), x.std((1, 2, 3, 4)), atol=1e-5, rtol=1e-5)
        assert (out - x).abs().amax((1, 2, 3, 4)).min() > 0.05, op.__name__  # every sample changed
        flat_x, flat_out = x.flatten(1), out.flatten(1)  # a monotone map of each sample's voxels
        order = flat_x.argsort(1)
        assert (flat_out.gather(1, order).diff(dim=1) >= -1e-5).all(), op.__name__
        flat = torch.full((2, 1, 4, 4, 4), 0.7)  # a constant sample stays itself: no division by a zero std
        torch.testing.assert_close(op(flat, torch.tensor([0.5, 2.0])), flat)


def _reference_log_sharpen(img: torch.Tensor, sigma: float) -> torch.Tensor:
    """x - LoG(x) with MONAI's separable_filtering (conv3d, 9 passes), clipped to the input range."""
    from monai.networks.layers import gaussian_1d

    g = gaussian_1d(torch.tensor(sigma), truncated=4.0, approx="sampled", normalize=True)
    t = torch.arange(-((g.numel() - 1) // 2), (g.numel() - 1) // 2 + 1, dtype=g.dtype)
    d2 = (t**2 / sigma**4 - 1.0 / sigma**2) * g
    d2 = d2 - d2.mean()
    x = img[None]
    log = sum(separable_filtering(x, [d2 if i == a else g for i in range(3)], mode="replicate") for a in range(3))
    return (img - log[0]).clamp(img.min(), img.max())


def test_filters_equal_monai_per_sample() -> None:
    x = _rand(3, 2, 9, 10, 11)
    sigmas = [0.45, 0.7, 0.95]  # different kernel lengths in one batch
    blurred, sharp = filters.gaussian_blur_batch(x, sigmas), filters.log_sharpen_batch(x, sigmas)
    for i, s in enumerate(sigmas):
        torch.testing.assert_close(blurred[i], GaussianSmooth(s)(x[i]).as_tensor(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(sharp[i], _reference_log_sharpen(x[i], s), atol=1e-5, rtol=1e-5)


def test_select_leaves_unselected_samples_bit_for_bit() -> None:
    x = _rand(4, 1, 6, 6, 6)
    out = intensity.select(x, torch.tensor([False, True, False, True]), intensity.scale, torch.tensor([9.0] * 4))
    assert torch.equal(out[0], x[0]) and torch.equal(out[2], x[2])
    torch.testing.assert_close(out[1], x[1] * 9.0)
    assert intensity.select(x, torch.zeros(4, dtype=torch.bool), intensity.scale, torch.ones(4)) is x


# ---------------------------------------------------------------------------------------------- batched TRA
def _params(n: int, seed: int, policy_preset: str = "uniform") -> list[TRAParams]:
    policy = make_tra_policy(policy_preset)
    rng = np.random.RandomState(seed)
    return [sample_tra_params(policy.sample_ops(0, rng), rng) for _ in range(n)]


def test_batched_cascade_equals_per_sample_on_the_same_params() -> None:
    params = _params(12, seed=3)
    img, lab = _rand(12, 1, 12, 12, 12), (_rand(12, 1, 12, 12, 12, seed=4) * 3).floor().to(torch.uint8)
    before = (img.clone(), lab.clone())
    bi, bl = apply_tra_batch({"image": img}, {"label": lab}, params)
    assert torch.equal(img, before[0]) and torch.equal(lab, before[1])  # the caller's batch is never written
    assert bl["label"].dtype == torch.uint8
    for i, p in enumerate(params):
        si, sl = apply_tra({"image": img[i]}, {"label": lab[i]}, p)
        torch.testing.assert_close(bi["image"][i], si["image"], atol=2e-5, rtol=1e-4)
        assert (bl["label"][i] != sl["label"]).float().mean() < 0.01  # nearest: ties may round either way


def test_identity_samples_are_returned_bit_for_bit() -> None:
    params = [TRAParams(), TRAParams(scale=1.3, gamma=1.2, flip_axes=[1], noise_std=0.1, blur_sigma=0.6), TRAParams()]
    img, lab = _rand(3, 1, 10, 10, 10), (_rand(3, 1, 10, 10, 10, seed=1) > 0.5).float()
    before = (img.clone(), lab.clone())
    oi, ol = apply_tra_batch({"image": MetaTensor(img)}, {"label": lab}, params)
    assert torch.equal(img, before[0]) and torch.equal(lab, before[1])
    for i in (0, 2):
        assert torch.equal(oi["image"][i], img[i]) and torch.equal(ol["label"][i], lab[i])
    assert not torch.equal(oi["image"][1], img[1])


def test_one_grid_sample_call_per_key_for_the_whole_batch(monkeypatch) -> None:
    calls = []
    real = F.grid_sample

    def counting(inp, grid, *args, **kwargs):
        calls.append((tuple(inp.shape), kwargs.get("mode")))
        return real(inp, grid, *args, **kwargs)

    monkeypatch.setattr(F, "grid_sample", counting)
    params = [TRAParams(scale=1.2), TRAParams(), TRAParams(angles=[0.1, 0.2, 0.3]), TRAParams(scale=0.8)]
    apply_tra_batch({"image": _rand(4, 1, 8, 8, 8)}, {"label": _rand(4, 1, 8, 8, 8)}, params)
    assert calls == [((3, 1, 8, 8, 8), "bilinear"), ((3, 1, 8, 8, 8), "nearest")]  # the 3 samples with an affine


def _patch(fg: bool, seed: int) -> dict:
    lab = torch.zeros(1, 12, 12, 12)
    if fg:
        lab[0, 4:8, 4:8, 4:8] = 1
    return {"image": MetaTensor(_rand(1, 12, 12, 12, seed=seed)), "label": MetaTensor(lab)}


def test_batch_transform_draws_exactly_as_the_per_sample_cascade() -> None:
    policy = make_tra_policy("nnunet", num_groups=2)
    samples = [ClassGroupd("label")(_patch(i % 3 == 0, i)) for i in range(40)]
    per_sample = TRACascaded("image", policy, label_keys="label").set_random_state(7)
    batched = BatchTRACascaded("image", policy, label_keys="label", device=DEVICE).set_random_state(7)
    expected = [per_sample(dict(s)) for s in samples]
    out = batched(list_data_collate(samples))
    assert out["tra_ops"].shape == (40, len(TRA_SERIES)) and out["tra_ops"].dtype == torch.long
    assert torch.equal(out["tra_ops"], torch.stack([e["tra_ops"] for e in expected]))  # same ops, same groups
    assert torch.equal(out["class_group"], torch.tensor([1 if i % 3 == 0 else 0 for i in range(40)]))
    # same magnitudes too: the outputs agree sample by sample
    for i, e in enumerate(expected):
        torch.testing.assert_close(out["image"][i].as_tensor(), e["image"].as_tensor(), atol=2e-5, rtol=1e-4)
    # the op parameters' distributions are those of the per-sample path: the same draws, in the same order
    rng = np.random.RandomState(1)
    replay = []
    for _ in range(300):
        c = policy.sample_ops(1, rng)
        replay.append((c, sample_tra_params(c, rng)))
    drawn, params = batched.set_random_state(1).randomize([1] * 300)
    assert np.array_equal(drawn, np.stack([c for c, _ in replay]))
    assert params == [p for _, p in replay]


def test_batch_transform_errors_are_clear() -> None:
    policy = make_tra_policy("nnunet", num_groups=2)
    batch = list_data_collate([_patch(True, 0), _patch(False, 1)])
    with pytest.raises(KeyError, match="class group key 'class_group' missing"):
        BatchTRACascaded("image", policy, label_keys="label")(batch)
    batch["tra_ops"] = torch.zeros(2, 15, dtype=torch.long)
    batch["class_group"] = torch.tensor([1, 0])
    with pytest.raises(ValueError, match="not both"):
        BatchTRACascaded("image", policy, label_keys="label")(batch)
    with pytest.raises(ValueError, match="15 TRA series"):
        BatchTRACascaded("image", make_tra_policy("nnunet").__class__([3]))
    with pytest.raises(ValueError, match="padding_mode must be one of"):
        BatchTRACascaded("image", policy, padding_mode="reflection")
    other = {"other": torch.ones(2), "class_group": torch.tensor([1, 0])}
    with pytest.raises(KeyError, match="image"):
        BatchTRACascaded("image", policy, label_keys="label")(other)
    assert BatchTRACascaded("image", policy, label_keys="label", allow_missing_keys=True)(other) == other


def test_device_augmentation_feeds_the_trainer_and_the_tra_update() -> None:
    from helpers import lesion_batch, tiny_unet, train_engine
    from jcsaug.engine import DeviceAugmentation, TRAPolicyUpdater

    set_determinism(seed=0)
    policy = make_tra_policy("uniform", num_groups=2)
    net = tiny_unet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    engine = train_engine(net, opt)
    seen = []
    engine.add_event_handler(Events.ITERATION_STARTED, lambda e: seen.append(e.state.batch["tra_ops"].clone()))
    augment = DeviceAugmentation(BatchTRACascaded("image", policy, label_keys="label", device=DEVICE))
    augment.transform.set_random_state(0)
    augment.attach(engine)
    updater = TRAPolicyUpdater(policy, net, [lesion_batch(4, seed=99)], opt, lr=0.05)
    updater.attach(engine)
    before = policy.logits.detach().clone()
    batches = [{k: v for k, v in lesion_batch(4, seed=i).items()} for i in range(3)]
    engine.run(batches, max_epochs=1)
    set_determinism(None)
    assert len(seen) == 3 and all(s.shape == (4, 15) for s in seen)
    assert updater.updates == 3 and not torch.equal(policy.logits, before)


def _with_and_without_copies(make: bool, cascade: str) -> list[dict]:
    """Two calls of a seeded cascade with two counterfactual copies per sample, the first with
    ``make_counterfactuals=make``."""
    policy = make_tra_policy("uniform", num_groups=2)
    if cascade == "batch":
        tra = BatchTRACascaded("image", policy, label_keys="label", counterfactuals=2).set_random_state(3)
        first, second = lesion_batch_for_cascade(0), lesion_batch_for_cascade(1)
    else:
        tra = TRACascaded("image", policy, label_keys="label", counterfactuals=2).set_random_state(3)
        first, second = ({k: v[0] for k, v in lesion_batch_for_cascade(s).items()} for s in (0, 1))
    return [tra(first, make_counterfactuals=make), tra(second)]


def lesion_batch_for_cascade(seed: int) -> dict:
    from helpers import lesion_batch

    return {k: v.to(DEVICE) for k, v in lesion_batch(4, seed=seed).items()}


@pytest.mark.parametrize("cascade", ["batch", "sample"])
def test_copies_drawn_but_not_made_leave_the_samples_and_the_random_stream_as_they_were(cascade: str) -> None:
    made, drawn = _with_and_without_copies(True, cascade), _with_and_without_copies(False, cascade)
    assert {"image_cf", "label_cf", "tra_cf_ops"} <= made[0].keys()
    assert not {"image_cf", "label_cf", "tra_cf_ops"} & drawn[0].keys()  # not made: no keys
    for key in ("image", "label", "tra_ops"):  # the samples themselves as with the copies
        assert torch.equal(torch.as_tensor(made[0][key]), torch.as_tensor(drawn[0][key])), key
    assert made[1].keys() == drawn[1].keys()  # the next call: the same draws, copies included
    for key in made[1]:
        assert torch.equal(torch.as_tensor(made[1][key]), torch.as_tensor(drawn[1][key])), key


def _device_run(schedule: bool, start: float) -> tuple[torch.Tensor, list[int], int]:
    """A paired-TRA run augmenting on the device (updates every 2nd iteration after a warm-up of ``start``):
    the final logits, the iterations whose batch held copies, the updates made."""
    from helpers import lesion_batch, paired_tra_training
    from jcsaug.engine import DeviceAugmentation

    set_determinism(seed=0)
    policy, engine, updater = paired_tra_training(start)
    cascade = BatchTRACascaded("image", policy, label_keys="label", device=DEVICE, counterfactuals=2)
    augment = DeviceAugmentation(cascade.set_random_state(0), counterfactuals_for=updater if schedule else None)
    augment.attach(engine)
    with_copies = []
    engine.add_event_handler(
        Events.ITERATION_STARTED, lambda e: "image_cf" in e.state.batch and with_copies.append(e.state.iteration)
    )
    updater.attach(engine)
    engine.run([lesion_batch(4, seed=i) for i in range(4)], max_epochs=2)
    set_determinism(None)
    return policy.logits.detach().clone(), with_copies, updater.updates


def test_device_augmentation_refuses_copies_on_schedule_for_a_transform_that_cannot_skip_them() -> None:
    from monai.transforms import Compose

    from jcsaug.engine import DeviceAugmentation

    cascade = BatchTRACascaded("image", make_tra_policy("uniform", num_groups=2), counterfactuals=2)
    with pytest.raises(TypeError, match="make_counterfactuals.*Compose"):
        DeviceAugmentation(Compose([cascade]), counterfactuals_for=SimpleNamespace(updates_at=lambda e, i: True))


@pytest.mark.parametrize("start", [0.0, 0.5])
def test_device_augmentation_makes_copies_for_the_tra_updates_only_and_the_run_is_unchanged(start: float) -> None:
    logits, with_copies, updates = _device_run(schedule=True, start=start)
    every_logits, every_batch, every_updates = _device_run(schedule=False, start=start)
    assert every_batch == list(range(1, 9))
    assert with_copies == ([2, 4, 6, 8] if start == 0 else [6, 8])  # every 2nd iteration, after the warm-up's 4
    assert updates == every_updates == len(with_copies)  # none skipped: every update found its copies
    assert torch.equal(logits, every_logits)  # the same draws, so the same policy trajectory


# ---------------------------------------------------------------------------------------------- TEA
AFFINE_TEA = [op for op in TEA_OPS if op.kind in ("scale", "rotate")]


def test_tea_affine_ops_equal_monai_affine() -> None:
    x = _rand(1, 11, 12, 13)
    lab = (_rand(1, 11, 12, 13, seed=2) * 3).floor().long()
    for op in AFFINE_TEA:
        ref = Affine(affine=op.affine_matrix(), mode="bilinear", padding_mode="border", image_only=True)(x)
        torch.testing.assert_close(op.transform_image(x), ref.as_tensor(), atol=1e-5, rtol=1e-5)
        inv = Affine(affine=np.linalg.inv(op.affine_matrix()), mode="bilinear", padding_mode="border", image_only=True)
        torch.testing.assert_close(op.invert(x), inv(x).as_tensor(), atol=1e-5, rtol=1e-5)
        ref_lab = Affine(affine=op.affine_matrix(), mode="nearest", padding_mode="zeros", image_only=True)(lab.float())
        assert (op.transform_label(lab) != ref_lab.as_tensor().long()).float().mean() < 0.01


def test_batched_tea_ops_equal_the_per_op_methods_on_every_op() -> None:
    x = _rand(len(TEA_OPS), 1, 10, 10, 10)
    lab = (_rand(len(TEA_OPS), 1, 10, 10, 10, seed=3) * 3).floor().long()
    images, labels = apply_tea_ops(TEA_OPS, x, "image"), apply_tea_ops(TEA_OPS, lab, "label")
    inverted = apply_tea_ops(TEA_OPS, x, "invert")
    for k, op in enumerate(TEA_OPS):
        torch.testing.assert_close(images[k], op.transform_image(x[k]), atol=1e-6, rtol=1e-5, msg=op.name)
        assert torch.equal(labels[k], op.transform_label(lab[k])), op.name
        torch.testing.assert_close(inverted[k], op.invert(x[k]), atol=1e-6, rtol=1e-5, msg=op.name)


def test_tea_inverses_stay_exact_in_batches_of_non_cubic_volumes() -> None:
    exact = [op for op in TEA_OPS if op.kind in ("flip", "rot90")]
    x = _rand(len(exact), 2, 6, 7, 8)
    moved = apply_tea_ops(exact, x, "image")
    back = apply_tea_ops_by_shape(exact, moved, "invert")
    for k in range(len(exact)):
        assert torch.equal(back[k], x[k])


def test_tea_grids_are_built_once_per_op_and_shape(monkeypatch) -> None:
    clear_grid_cache()
    built = []
    real = tea.affine_grid

    def counting(*args, **kwargs):
        built.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(tea, "affine_grid", counting)
    ops = [TEA_OPS[3], TEA_OPS[12], TEA_OPS[3]]
    x = _rand(3, 1, 8, 9, 10)
    for _ in range(3):
        apply_tea_ops(ops, x, "image")
    assert len(built) == 2  # two distinct affine ops, one shape: built on the first call only
    apply_tea_ops(ops, x, "invert")
    assert len(built) == 4  # the inverse grids are cached separately
    # a custom op reusing a catalogue id gets its own grid, not the catalogue op's
    twenty = dataclasses.replace(TEA_OPS[11], name="rotate_frontal_acw_20", magnitude=20.0)
    assert not torch.equal(apply_tea_ops([twenty], x[:1], "image")[0], apply_tea_ops([TEA_OPS[11]], x[:1], "image")[0])


def test_tea_inference_update_and_joint_validation_use_the_batched_ops(monkeypatch) -> None:
    from helpers import lesion_batch, tiny_unet
    from jcsaug.engine import TEAPolicyUpdater
    from jcsaug.engine.tra_updater import tea_transform_batch
    from jcsaug.inference import TEAInferer
    from jcsaug.policy import make_tea_policy

    calls = []
    real = tea.apply_tea_ops

    def counting(ops, x, what="image", stats=None):
        calls.append((len(ops), what))
        return real(ops, x, what, stats)

    for module in ("jcsaug.inference.tta", "jcsaug.engine.tea_updater", "jcsaug.engine.tra_updater", "jcsaug.ops.tea"):
        monkeypatch.setattr(f"{module}.apply_tea_ops", counting)
    net = tiny_unet().eval()
    batch = lesion_batch(2)
    ops = [TEA_OPS[i] for i in (0, 3, 12, 38, 42, 72)]
    with torch.no_grad():
        out = TEAInferer(ops, [1.0] * len(ops))(batch["image"], net)
        expected = sum(op.invert(net(op.transform_image(batch["image"]))) for op in ops) / len(ops)
    assert calls == [(12, "image"), (12, "invert")]  # 6 ops x 2 images, each in one batched call
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)

    calls.clear()
    updater = TEAPolicyUpdater(make_tea_policy(), net, [batch], lr=0.05, num_copies=5)
    updater.update(SimpleNamespace(state=SimpleNamespace(iteration=1, max_epochs=1, epoch_length=1)))
    assert calls == [(5, "image"), (5, "invert")]  # the Z copies: one call each way (cubic patches: one shape)

    calls.clear()
    chunks = tea_transform_batch(batch["image"], batch["label"], make_tea_policy(), TEA_OPS, torch.Generator())
    assert calls == [(2, "image"), (2, "label")] and sum(len(x) for x, _ in chunks) == 2
