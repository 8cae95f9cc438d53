"""The TRA's context (the reference's enlarged crop): training patches cut larger by a context on each side, the
TRA's scalings and rotations read it and return the patch, so what they bring into view is image, not padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from monai.data import list_data_collate
from monai.transforms import Affine, RandCropByLabelClassesd, RandCropByPosNegLabeld, RandSpatialCropd

from jcsaug.data import ContextCropd, crop_with_context
from jcsaug.engine.preflight import check_settings
from jcsaug.ops.catalogue import Series
from jcsaug.ops.resample import resample
from jcsaug.ops.tra import (
    TRA_SERIES,
    TRAParams,
    affine_matrix,
    apply_tra,
    apply_tra_batch,
    resolve_tra_context,
    sample_tra_params,
    tra_catalogue,
    tra_context,
)
from jcsaug.policy import BatchTRACascaded, ClassGroupd, TRACascaded, make_tra_policy

pytestmark = pytest.mark.usefixtures("single_thread")


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------- resampling with a context
@pytest.mark.parametrize(
    "params",
    [
        TRAParams(scale=1.45),  # a zoom-out: factored (2D + 1D) on the CPU
        TRAParams(scale=0.83, angles=[0.0, 0.4, 0.0]),  # one axis + scaling: factored (0.8: ties in nearest)
        TRAParams(angles=[0.0, 0.0, -0.5]),  # one axis, no 1D pass: the crop along it comes first
        TRAParams(scale=1.2, angles=[0.2, -0.3, 0.35]),  # general: one 3D grid_sample
    ],
)
def test_the_patch_from_its_context_equals_monai_affine_to_the_patch_size(params: TRAParams) -> None:
    """With a context, the output is MONAI's ``Affine(spatial_size=patch)`` of the enlarged crop: the patch's
    centre is the crop's, and every output voxel reads the crop (one sample and a batch, two code paths)."""
    img = _rand(2, 30, 26, 34)
    lab = (_rand(1, 30, 26, 34, seed=1) * 3).floor()
    context = (7, 5, 9)
    patch = (16, 16, 16)
    oi, ol = apply_tra({"image": img}, {"label": lab}, params, context=context)
    bi, _ = apply_tra_batch({"image": torch.stack([img, img])}, {}, [params, params], context=context)
    for x, out, mode in ((img, oi["image"], "bilinear"), (lab, ol["label"], "nearest")):
        ref = Affine(rotate_params=params.angles, scale_params=[params.scale] * 3, spatial_size=patch, mode=mode,
                     padding_mode="zeros", image_only=True)(x).as_tensor()  # fmt: skip
        assert tuple(out.shape[1:]) == patch
        if mode == "bilinear":
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(bi["image"][0], ref, atol=1e-5, rtol=1e-5)  # the batched grid path
        else:  # nearest: equal except possibly at exact ties
            assert (out != ref).float().mean() < 0.01


def test_resample_refuses_an_output_not_centred_in_the_input() -> None:
    x, m = _rand(1, 1, 10, 10, 10), affine_matrix(TRAParams(scale=1.2))[None]
    for bad in ((9, 10, 10), (12, 10, 10)):
        with pytest.raises(ValueError, match="centred in the input size"):
            resample(x, m, out_size=bad)


def test_samples_without_an_affine_are_the_exact_centre_of_their_crop() -> None:
    params = [TRAParams(), TRAParams(scale=1.3, flip_axes=[1]), TRAParams(gamma=1.2), TRAParams(rot90=[(0, 1)])]
    img, lab = _rand(4, 1, 20, 20, 20), (_rand(4, 1, 20, 20, 20, seed=1) > 0.5).to(torch.uint8)
    before = (img.clone(), lab.clone())
    oi, ol = apply_tra_batch({"image": img}, {"label": lab}, params, context=4)
    assert torch.equal(img, before[0]) and torch.equal(lab, before[1])  # the caller's batch is never written
    assert oi["image"].shape == (4, 1, 12, 12, 12) and ol["label"].dtype == torch.uint8
    centre = (slice(None), slice(4, 16), slice(4, 16), slice(4, 16))
    assert torch.equal(oi["image"][0], img[0][centre]) and torch.equal(ol["label"][0], lab[0][centre])
    assert torch.equal(ol["label"][3], torch.rot90(lab[3][centre], 1, dims=(2, 3)))
    for i, p in enumerate(params):  # the batch agrees with each sample alone
        si, sl = apply_tra({"image": img[i]}, {"label": lab[i]}, p, context=4)
        torch.testing.assert_close(oi["image"][i], si["image"], atol=2e-5, rtol=1e-4)
        assert (ol["label"][i] != sl["label"]).float().mean() < 0.01


def test_the_auto_context_leaves_no_padding_in_view_where_the_cropped_patch_is_mostly_padding() -> None:
    """The gap this closes: the largest zoom-out with the largest rotation, on a patch as cropped, is about three
    quarters padding; from the patch's automatic context, none of it is."""
    patch = (32, 32, 32)
    context = tra_context(patch)
    worst = TRAParams(scale=1.5, angles=[0.0, np.radians(30.0), 0.0])
    enlarged = torch.ones(1, *(p + 2 * c for p, c in zip(patch, context)))
    out, _ = apply_tra({"image": enlarged}, {}, worst, context=context)
    as_cropped, _ = apply_tra({"image": torch.ones(1, *patch)}, {}, worst)
    assert out["image"].shape == (1, *patch)
    assert float((out["image"] < 0.999).float().mean()) == 0.0
    assert float((as_cropped["image"] < 0.999).float().mean()) > 0.5


def test_tra_context_follows_the_catalogues_spatial_ops() -> None:
    assert tra_context((32, 32, 32)) == (18, 18, 18)  # 1.5 x (15.5 x (cos 30 + sin 30)) - 15.5, + 1
    assert tra_context((64, 64, 64)) == tra_context((64, 64, 64), tra_catalogue("split-signs"))  # same magnitudes
    x, y, z = tra_context((128, 128, 8))
    assert x == y > 60 and z == 8  # at most the patch size on a thin axis
    intensity_only = tuple(s for s in TRA_SERIES if all(op.kind not in ("scale", "rotate") for op in s.ops))
    assert tra_context((32, 32, 32), intensity_only) == (0, 0, 0)
    rot90_only = (Series("r", tuple(op for op in TRA_SERIES[1].ops if op.kind == "rot90")),)
    assert tra_context((32, 32, 32), rot90_only) == (0, 0, 0)  # quarter turns act on the patch itself


def test_the_tra_context_setting() -> None:
    assert resolve_tra_context("auto", (32, 32, 32)) == (18, 18, 18)
    assert resolve_tra_context(0, (32, 32, 32)) == (0, 0, 0)
    assert resolve_tra_context([4, 4, 2], (32, 32, 32)) == (4, 4, 2)
    for bad in ("big", -1, [1, 2], 2.5, True):
        with pytest.raises(ValueError, match="tra_context must be"):
            resolve_tra_context(bad, (32, 32, 32))
    with pytest.raises(ValueError, match="tra_context"):
        check_settings(tra_context="big")
    check_settings(tra_context="auto")
    check_settings(tra_context=[2, 2, 0])


# ------------------------------------------------------------------------------------------------ the enlarged crop
def _volume(seed: int = 0) -> dict:
    label = torch.zeros(1, 24, 20, 28)
    label[0, 3:9, 12:18, 20:26] = 1  # near the border: enlarged crops reach beyond the volume
    label[0, 14:18, 4:8, 6:10] = 2
    return {"image": _rand(1, 24, 20, 28, seed=seed) + 1.0, "label": label}


@pytest.mark.parametrize(
    "make_crop",
    [
        lambda: RandCropByPosNegLabeld(["image", "label"], "label", spatial_size=(10, 12, 8), num_samples=6),
        lambda: RandCropByLabelClassesd(
            ["image", "label"], "label", spatial_size=(10, 12, 8), num_classes=3, num_samples=6
        ),  # fmt: skip
    ],
)
def test_context_crop_is_the_patch_with_its_surroundings(make_crop) -> None:
    """Each enlarged patch's centre is the patch the crop gives alone (same seed, same centres), and beyond the
    volume it holds the fill value."""
    volume = _volume()
    plain = make_crop().set_random_state(3)(dict(volume))
    enlarged = ContextCropd(make_crop(), context=(5, 4, 6), fill={"label": 255}).set_random_state(3)(dict(volume))
    assert len(enlarged) == len(plain) == 6
    beyond = 0
    for p, e in zip(plain, enlarged):
        assert tuple(e["image"].shape[1:]) == (20, 20, 20)
        centre = (slice(None), slice(5, 15), slice(4, 16), slice(6, 14))
        assert torch.equal(torch.as_tensor(e["image"][centre]), torch.as_tensor(p["image"]))
        assert torch.equal(torch.as_tensor(e["label"][centre]), torch.as_tensor(p["label"]))
        outside = torch.as_tensor(e["image"]) == 0  # the image is > 0 everywhere inside the volume
        assert torch.equal(outside, torch.as_tensor(e["label"]) == 255)
        beyond += int(outside.sum())
        assert (
            ClassGroupd("label", mapping={0: 0, 1: 1, 2: 2, 255: 0})(e)["class_group"]
            == ClassGroupd("label", mapping={0: 0, 1: 1, 2: 2})(p)["class_group"]
        )  # the centre voxel, and so the class group, is the patch's
    assert beyond > 0  # some crops reached beyond the volume


def test_context_crop_of_zero_is_the_crop_itself_and_other_crops_are_refused() -> None:
    volume = _volume()
    make = lambda: RandCropByPosNegLabeld(["image", "label"], "label", spatial_size=(8, 8, 8), num_samples=3)  # noqa: E731
    plain = make().set_random_state(1)(dict(volume))
    same = ContextCropd(make(), context=0).set_random_state(1)(dict(volume))
    assert all(torch.equal(torch.as_tensor(a["image"]), torch.as_tensor(b["image"])) for a, b in zip(plain, same))
    with pytest.raises(TypeError, match="draws patch centres"):
        ContextCropd(RandSpatialCropd(["image"], roi_size=(8, 8, 8)), context=2)
    with pytest.raises(ValueError, match="context"):
        ContextCropd(make(), context=-1)


class _PosNegCrop(RandCropByPosNegLabeld):
    """Not in ContextCropd's registry of centre drawers: ContextCropd lets it cut the patches (MONAI's path)."""


class _LabelClassesCrop(RandCropByLabelClassesd):
    """As above, for RandCropByLabelClassesd."""


@pytest.mark.parametrize(
    "make_crop",
    [
        lambda cls, **kw: cls(["image", "label"], "label", spatial_size=(10, 12, 8), num_samples=5, **kw),
        lambda cls, **kw: cls(["image", "label"], "label", spatial_size=(10, -1, 8), num_samples=5, **kw),
        lambda cls, **kw: cls(
            ["image", "label"], "label", spatial_size=(30, 12, 8), num_samples=5, allow_smaller=True, **kw
        ),  # larger than the volume's 24 along the first axis
    ],
)
@pytest.mark.parametrize("with_indices", [False, True])
@pytest.mark.parametrize("crop_type", ["pos_neg", "label_classes"])
def test_context_crop_of_plain_tensors_draws_alone_and_gives_what_monais_cuts_give(
    make_crop, with_indices: bool, crop_type: str
) -> None:
    """The fast path (the crop draws the centres, each key is cut once) gives the patches of MONAI's path (the crop
    cuts, each patch is cut again): the same keys in the same order, voxels, dtypes and deep-copied entries, an
    indices entry dropped as the crop drops it, and the random stream left where MONAI's leaves it."""
    from monai.transforms import ClassesToIndicesd, FgBgToIndicesd

    if crop_type == "pos_neg":
        registered, unregistered = RandCropByPosNegLabeld, _PosNegCrop
        indices = FgBgToIndicesd("label")
        kwargs = {"fg_indices_key": "label_fg_indices", "bg_indices_key": "label_bg_indices"} if with_indices else {}
    else:
        registered, unregistered = RandCropByLabelClassesd, _LabelClassesCrop
        indices = ClassesToIndicesd("label", num_classes=3)
        kwargs = {"num_classes": 3, **({"indices_key": "label_cls_indices"} if with_indices else {})}
    volume = {**_volume(), "name": "case_7", "spacing": np.array([1.0, 1.0, 2.5])}
    volume["label"] = volume["label"].to(torch.uint8)
    if with_indices:
        volume = indices(volume)
    fast_crop, monai_crop = (
        ContextCropd(make_crop(cls, **kwargs), context=(5, 4, 6), fill={"label": 255}).set_random_state(4)
        for cls in (registered, unregistered)
    )
    fast, through_monai = fast_crop(dict(volume)), monai_crop(dict(volume))
    assert len(fast) == len(through_monai) == 5
    for f, m in zip(fast, through_monai):
        assert list(f) == list(m) and not any(k.endswith("indices") for k in f)
        for key in ("image", "label"):
            assert type(f[key]) is torch.Tensor and f[key].dtype == volume[key].dtype
            assert torch.equal(f[key], torch.as_tensor(m[key])), key
        assert f["name"] == "case_7" and np.array_equal(f["spacing"], m["spacing"])
        assert f["spacing"] is not volume["spacing"] and f["spacing"] is not m["spacing"]  # deep copies
    assert fast_crop.crop.cropper.R.rand() == monai_crop.crop.cropper.R.rand()


def test_context_crop_of_a_metatensor_keeps_monais_path() -> None:
    """A MetaTensor is cut by the crop itself, so its patches carry MONAI's record of the crop."""
    from monai.data import MetaTensor

    volume = {key: MetaTensor(value) for key, value in _volume().items()}
    crop = RandCropByPosNegLabeld(["image", "label"], "label", spatial_size=(10, 12, 8), num_samples=2)
    patches = ContextCropd(crop, context=2).set_random_state(0)(volume)
    assert all(isinstance(p["image"], MetaTensor) and len(p["image"].applied_operations) for p in patches)


def test_crop_with_context_places_the_centre_as_monai_does() -> None:
    img = torch.arange(10.0).reshape(1, 10, 1, 1).expand(1, 10, 3, 3)
    out = crop_with_context(img, (1, 1, 1), (6, 3, 3), fill=-1)
    assert out[0, :, 1, 1].tolist() == [-1.0, -1.0, 0.0, 1.0, 2.0, 3.0]  # centre voxel (index 3) is voxel 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_crop_with_context_keeps_a_plain_tensor_plain_and_cuts_it_as_monai_cuts_a_metatensor(dtype) -> None:
    """A plain tensor takes the fast path (a slice and torch's pad); a MetaTensor MONAI's SpatialCrop and Pad, which
    record both steps. The voxels and the dtype are the same, inside the volume and beyond it."""
    from monai.data import MetaTensor

    img = (_rand(2, 24, 20, 28) * 200).to(dtype)
    for centre in [(2, 3, 25), (12, 10, 14), (0, 19, 0), (23, 0, 27)]:
        for size in [(10, 12, 8), (30, 30, 30), (7, 5, 9)]:
            plain = crop_with_context(img, centre, size, fill=255)
            meta = crop_with_context(MetaTensor(img), centre, size, fill=255)
            assert type(plain) is torch.Tensor and isinstance(meta, MetaTensor) and len(meta.applied_operations)
            assert plain.dtype == meta.dtype == dtype and torch.equal(plain, meta.as_tensor()), (centre, size)


# -------------------------------------------------------------------------------------------- the cascades
def _enlarged_patches(n: int, context: int) -> list[dict]:
    out = []
    for i in range(n):
        size = 12 + 2 * context
        label = torch.zeros(1, size, size, size)
        if i % 2:
            label[0, size // 2 - 2 : size // 2 + 2, size // 2 - 2 : size // 2 + 2, size // 2 - 2 : size // 2 + 2] = 1
        out.append(ClassGroupd("label")({"image": _rand(1, size, size, size, seed=i), "label": label}))
    return out


def test_cascades_return_the_patch_and_its_counterfactual_copies_from_the_context() -> None:
    policy = make_tra_policy("nnunet", num_groups=2)
    samples = _enlarged_patches(8, context=5)
    per_sample = TRACascaded("image", policy, label_keys="label", context=5).set_random_state(4)
    batched = BatchTRACascaded("image", policy, label_keys="label", context=5).set_random_state(4)
    expected = [per_sample(dict(s)) for s in samples]
    out = batched(list_data_collate(samples))
    assert out["image"].shape == (8, 1, 12, 12, 12) and out["label"].shape == (8, 1, 12, 12, 12)
    assert torch.equal(out["tra_ops"], torch.stack([e["tra_ops"] for e in expected]))  # the same draws
    for i, e in enumerate(expected):
        torch.testing.assert_close(torch.as_tensor(out["image"][i]), torch.as_tensor(e["image"]), atol=2e-5,
                                   rtol=1e-4)  # fmt: skip
    # the paired estimator's copies: the patch size too, each the sample's own patch but for one series
    copies = TRACascaded("image", policy, label_keys="label", context=5, counterfactuals=2).set_random_state(4)
    one = copies(dict(samples[1]))
    assert one["image_cf"].shape == one["label_cf"].shape == (2, 1, 12, 12, 12)
    batch = BatchTRACascaded("image", policy, label_keys="label", context=5, counterfactuals=2)
    out = batch.set_random_state(4)(list_data_collate(samples))
    assert out["image_cf"].shape == (8, 2, 1, 12, 12, 12) and out["label_cf"].shape == (8, 2, 1, 12, 12, 12)


def test_cascade_errors_name_the_key_too_small_for_its_context() -> None:
    policy = make_tra_policy("nnunet", num_groups=1)
    with pytest.raises(ValueError, match="'image' has spatial shape"):
        TRACascaded("image", policy, context=6)({"image": torch.rand(1, 12, 12, 12)})
    with pytest.raises(ValueError, match="TRACascaded: the TRA context"):
        TRACascaded("image", policy, context=(1, 2))
    rng = np.random.RandomState(0)
    params = sample_tra_params(policy.sample_ops(0, rng), rng)
    with pytest.raises(ValueError, match="not larger than twice"):
        apply_tra({"image": torch.rand(1, 8, 8, 8)}, {}, params, context=4)
