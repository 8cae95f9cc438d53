"""The TRA catalogue of SPEC §2: ops do what the table says."""

import math

import numpy as np
import pytest
import torch

from helpers import retaining_stats
from jcsaug.ops import tra
from jcsaug.ops.tra import TRA_SERIES, TRAParams, apply_tra, sample_tra_params, tra_catalogue_json

NAMES = [s.name for s in TRA_SERIES]


def _choices(**chosen):
    c = [0] * len(TRA_SERIES)
    for name, index in chosen.items():
        c[NAMES.index(name)] = index
    return c


def test_catalogue_sizes():
    assert len(TRA_SERIES) == 15
    assert sum(len(s.ops) for s in TRA_SERIES) == 47
    assert sum(s.size for s in TRA_SERIES) == 62
    cat = tra_catalogue_json()
    assert [len(s["ops"]) for s in cat] == [6, 5, 5, 5, 2, 2, 2, 4, 4, 4, 4, 4, 7, 4, 4]
    assert all(s["ops"][0]["name"] == "identity" for s in cat)


def test_magnitudes_stay_in_their_bins_with_random_sign():
    rng = np.random.RandomState(0)
    factors, angles = [], []
    for _ in range(400):
        p = sample_tra_params(_choices(scale=3, rotate_longitudinal=2), rng)
        factors.append(p.scale)
        angles.append(math.degrees(p.angles[2]))
    factors, angles = np.array(factors), np.array(angles)
    up, down = factors[factors > 1], factors[factors < 1]
    assert len(up) > 150 and len(down) > 150  # sign ~ 1/2 each
    assert ((up >= 1.2) & (up < 1.3)).all() and ((1 / down >= 1.2) & (1 / down < 1.3)).all()
    assert ((np.abs(angles) >= 10) & (np.abs(angles) < 20)).all()
    assert (angles > 0).sum() > 150 and (angles < 0).sum() > 150


def test_flip_is_exact_and_moves_label_with_image():
    img = torch.rand(1, 6, 7, 8)
    lab = (torch.rand(1, 6, 7, 8) > 0.5).to(torch.uint8)
    p = sample_tra_params(_choices(mirror_sagittal=1, mirror_axial=1), np.random.RandomState(0))
    oi, ol = apply_tra({"image": img}, {"label": lab}, p)
    assert torch.equal(oi["image"], torch.flip(img, dims=[1, 3]))
    assert torch.equal(ol["label"], torch.flip(lab, dims=[1, 3]))
    assert ol["label"].dtype == torch.uint8


def test_rot90_is_exact_in_the_right_plane():
    img = torch.rand(1, 6, 6, 9)
    p = sample_tra_params(_choices(rotate_longitudinal=4), np.random.RandomState(0))
    assert p.rot90 and p.rot90[0][0] == 2
    out, _ = apply_tra({"image": img}, {}, p)
    assert torch.equal(out["image"], torch.rot90(img, p.rot90[0][1], dims=(1, 2)))


def test_gamma_maps_mid_grey_into_expected_interval():
    img = torch.linspace(0, 1, 11 * 11 * 11).reshape(1, 11, 11, 11)
    rng = np.random.RandomState(3)
    signs = set()
    for _ in range(30):
        p = sample_tra_params(_choices(gamma=2), rng)  # gamma in [.2,.4) -> exponent (1+g)^±1
        out, _ = apply_tra({"image": img}, {}, p)
        v = out["image"][0, 5, 5, 5].item()
        signs.add(p.gamma > 1)
        ends = (1.2, 1.4) if p.gamma > 1 else (1 / 1.2, 1 / 1.4)
        lo, hi = sorted(retaining_stats(img**e, img)[0, 5, 5, 5].item() for e in ends)
        assert lo - 1e-4 <= v <= hi + 1e-4
        assert (v < 0.5) == (p.gamma > 1)  # a power above 1 darkens mid grey
    assert signs == {True, False}


def test_intensity_ops_values():
    img = torch.arange(27, dtype=torch.float32).reshape(1, 3, 3, 3) / 26.0
    cases = {
        "shift": (TRAParams(shift=0.15), img + 0.15),
        "scale": (TRAParams(intensity_factor=1.2), img * 1.2),
        "contrast": (TRAParams(contrast_factor=0.8), (img - img.mean()) * 0.8 + img.mean()),
        "inverted gamma": (TRAParams(inverted_gamma=2.0), 1 - retaining_stats((1 - img) ** 2.0, 1 - img)),
    }
    for name, (p, expected) in cases.items():
        out, _ = apply_tra({"image": img}, {}, p)
        torch.testing.assert_close(out["image"], expected, atol=1e-5, rtol=1e-5, msg=name)


def test_blur_sharpen_noise_lowres_change_image_not_label():
    torch.manual_seed(0)
    img = torch.rand(1, 16, 16, 16)
    lab = (img > 0.8).long()
    for p in (
        TRAParams(blur_sigma=0.8),
        TRAParams(sharpen_sigma=0.5),
        TRAParams(noise_std=0.1, noise_seed=3),
        TRAParams(lowres_zoom=0.5),
    ):
        oi, ol = apply_tra({"image": img}, {"label": lab}, p)
        assert not torch.allclose(oi["image"], img)
        assert torch.equal(ol["label"], lab)
    blurred, _ = apply_tra({"image": img}, {}, TRAParams(blur_sigma=0.9))
    sharp, _ = apply_tra({"image": img}, {}, TRAParams(sharpen_sigma=0.9))
    assert blurred["image"].std() < img.std() < sharp["image"].std() + 1e-6
    noisy, _ = apply_tra({"image": torch.zeros(1, 16, 16, 16)}, {}, TRAParams(noise_std=0.1, noise_seed=1))
    assert abs(noisy["image"].std().item() - 0.1) < 0.01


def test_spatial_ops_keep_label_values_and_resample_once(monkeypatch):
    calls = []
    real = tra.resample

    def counting(x, matrices, **kw):
        calls.append(kw["mode"])
        return real(x, matrices, **kw)

    monkeypatch.setattr(tra, "resample", counting)
    img = torch.rand(1, 20, 20, 20)
    lab = torch.zeros(1, 20, 20, 20, dtype=torch.long)
    lab[0, 5:15, 6:14, 4:16] = 1
    lab[0, 8:12, 8:12, 8:12] = 3
    rng = np.random.RandomState(0)
    for _ in range(5):
        calls.clear()
        c = _choices(scale=5, rotate_frontal=3, rotate_sagittal=2, rotate_longitudinal=1, mirror_frontal=1)
        p = sample_tra_params(c, rng)
        _, ol = apply_tra({"image": img}, {"label": lab}, p)
        assert calls == ["bilinear", "nearest"]  # one resampling of the image, one of the label
        assert set(ol["label"].unique().tolist()) <= {0, 1, 3}
        assert ol["label"].dtype == torch.long


def test_2d_image_is_refused_with_its_shape():
    with pytest.raises(ValueError, match=r"key 'image' has shape \(1, 8, 8\)"):
        apply_tra({"image": torch.zeros(1, 8, 8)}, {}, TRAParams(flip_axes=[0]))


def test_wrong_number_of_choices():
    with pytest.raises(ValueError, match="expected 15 op choices"):
        sample_tra_params([0] * 14, np.random.RandomState(0))
    with pytest.raises(IndexError, match="series 'scale' has 6 choices"):
        sample_tra_params([9] + [0] * 14, np.random.RandomState(0))


def test_single_grid_resampling_equals_monai_affine():
    from monai.transforms import Affine

    torch.manual_seed(0)
    img = torch.rand(2, 12, 10, 14)
    lab = (torch.rand(1, 12, 10, 14) * 3).floor()
    p = TRAParams(scale=1.3, angles=[0.2, -0.1, 0.35])
    oi, ol = apply_tra({"image": img}, {"label": lab}, p)
    for x, out, mode in ((img, oi["image"], "bilinear"), (lab, ol["label"], "nearest")):
        ref = Affine(
            rotate_params=p.angles, scale_params=[p.scale] * 3, mode=mode, padding_mode="zeros", image_only=True
        )(x)
        torch.testing.assert_close(out, ref.as_tensor(), atol=1e-5, rtol=1e-5)


def test_unknown_op_name_is_named():
    scale = TRA_SERIES[0]
    assert scale.index_of("scale±[0.1,0.2)") == 2
    with pytest.raises(KeyError, match=r"series 'scale' has no op 'zoom'"):
        scale.index_of("zoom")
