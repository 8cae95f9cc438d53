"""The TEA's intensity ops on a validation patch read its volume's statistics (``VolumeStatsd``,
``tea_volume_stats``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ignite.engine import Engine
from monai.data import DataLoader, Dataset
from monai.transforms import RandCropByPosNegLabeld

from helpers import SMALL_DATASET_KEPT, bundle_parser, small_dataset
from jcsaug.data import VolumeStatsd, batch_volume_stats
from jcsaug.engine import TEAPolicyUpdater
from jcsaug.engine import tea_updater as tea_updater_module
from jcsaug.engine import tra_updater as tra_updater_module
from jcsaug.ops import intensity
from jcsaug.ops.tea import apply_tea_ops, get_tea_op
from jcsaug.policy import CategoricalPolicy, make_tea_policy
from test_bundle_hardening import _workflow

RANGE_OPS = ["gamma_expand_0.5", "gamma_compress_0.5", "inverted_gamma_expand_0.3", "inverted_gamma_compress_0.5"]
PATCH = (slice(None), slice(4, 14), slice(6, 16), slice(2, 12))  # a corner-ish [1, 10, 10, 10] patch of the volume


def _volume(seed: int = 0) -> torch.Tensor:
    """A [1, 20, 20, 20] volume whose patch PATCH has a narrower range and another mean than the whole."""
    g = torch.Generator().manual_seed(seed)
    volume = torch.randn(1, 20, 20, 20, generator=g)
    volume[:, 12:, 12:, 12:] += 4.0  # a bright corner outside the patch
    return volume


def _stats_of(volume: torch.Tensor, rows: int = 1) -> dict[str, torch.Tensor]:
    return {
        "min": volume.min().expand(rows),
        "max": volume.max().expand(rows),
        "mean": volume.mean().expand(rows),
    }


def _affine_residual(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far ``a`` is from an affine map of ``b`` (the residual's std over ``a``'s std, 0 = exactly affine)."""
    x, y = b.flatten().double(), a.flatten().double()
    design = torch.stack([x, torch.ones_like(x)], 1)
    coef = torch.linalg.lstsq(design, y[:, None]).solution
    return float((y - (design @ coef)[:, 0]).std() / y.std())


@pytest.mark.parametrize("name", RANGE_OPS)
def test_a_gamma_with_the_volume_stats_bends_the_patch_as_it_bends_the_volume(name):
    """With its volume's range, a gamma on the patch is the patch of the gamma on the volume up to the affine map
    that keeps the patch's mean and std; with the patch's own range it is another curve."""
    op, volume = get_tea_op(name), _volume()
    on_volume = apply_tea_ops([op], volume[None])[0][PATCH]
    patch = volume[PATCH]
    with_stats = apply_tea_ops([op], patch[None], stats=_stats_of(volume))[0]
    own = apply_tea_ops([op], patch[None])[0]
    assert _affine_residual(with_stats, on_volume) < 1e-4
    assert _affine_residual(own, on_volume) > 1e-2  # the test can tell the two apart
    # the patch keeps its own mean and std either way (retain_stats)
    assert with_stats.mean().item() == pytest.approx(patch.mean().item(), abs=1e-4)
    assert with_stats.std().item() == pytest.approx(patch.std().item(), rel=1e-4)


def test_contrast_with_the_volume_mean_is_the_patch_of_the_contrast_on_the_volume():
    volume = _volume(1)
    patch = volume[PATCH]
    for name in ("contrast_up_0.25", "contrast_down_0.15"):
        op = get_tea_op(name)
        on_volume = apply_tea_ops([op], volume[None])[0][PATCH]
        assert torch.allclose(apply_tea_ops([op], patch[None], stats=_stats_of(volume))[0], on_volume, atol=1e-5)
        assert not torch.allclose(apply_tea_ops([op], patch[None])[0], on_volume, atol=1e-2)


def test_sharpening_clips_to_the_volume_range():
    """Away from the patch's border (where the filter's padding differs) sharpening with the volume's range is the
    patch of the sharpened volume; the patch's own range clips more."""
    volume = _volume(2)
    op = get_tea_op("sharpen_0.5")
    on_volume = apply_tea_ops([op], volume[None])[0][PATCH][:, 3:-3, 3:-3, 3:-3]
    patch = volume[PATCH]
    with_stats = apply_tea_ops([op], patch[None], stats=_stats_of(volume))[0][:, 3:-3, 3:-3, 3:-3]
    own = apply_tea_ops([op], patch[None])[0][:, 3:-3, 3:-3, 3:-3]
    assert torch.allclose(with_stats, on_volume, atol=1e-4)
    assert not torch.allclose(own, on_volume, atol=1e-3)


@pytest.mark.parametrize("name", [*RANGE_OPS, "contrast_up_0.25", "sharpen_0.9", "noise_0.075", "blur_0.7"])
def test_a_patchs_own_stats_given_change_nothing(name):
    """Statistics equal to the patch's own give the op without statistics (to float precision)."""
    patch = _volume(3)[PATCH]
    op = get_tea_op(name)
    given = apply_tea_ops([op, op], torch.stack([patch, patch]), stats=_stats_of(patch, 2))
    own = apply_tea_ops([op, op], torch.stack([patch, patch]))
    for a, b in zip(given, own):
        assert torch.allclose(a, b, atol=1e-5)


def test_each_row_reads_its_own_volume_stats():
    """A batch of rows from two volumes: each row's op reads its own entry of the statistics."""
    a, b = _volume(4), _volume(5) * 2 + 1
    op = get_tea_op("gamma_compress_0.5")
    rows = torch.stack([a[PATCH], b[PATCH]])
    stats = {k: torch.cat([_stats_of(a)[k], _stats_of(b)[k]]) for k in intensity.VOLUME_STAT_NAMES}
    both = apply_tea_ops([op, op], rows, stats=stats)
    assert torch.equal(both[0], apply_tea_ops([op], rows[:1], stats=_stats_of(a))[0])
    assert torch.equal(both[1], apply_tea_ops([op], rows[1:], stats=_stats_of(b))[0])


def test_a_padded_patch_below_the_volume_minimum_stays_finite():
    """A value below the given minimum (padding) is held at it: no NaN from a negative base's power."""
    volume = _volume(6)
    patch = volume[PATCH].clone()
    patch[:, 0] = volume.min() - 1.0
    for name in RANGE_OPS:
        out = apply_tea_ops([get_tea_op(name)], patch[None], stats=_stats_of(volume))[0]
        assert torch.isfinite(out).all(), name


def _stats_batches(volumes: list[torch.Tensor], with_stats: bool = True) -> DataLoader:
    items = [{"image": v, "label": (v > v.mean() + 1.0).float()} for v in volumes]  # both classes in every volume
    if with_stats:
        items = [VolumeStatsd("image")(d) for d in items]
    crop = RandCropByPosNegLabeld(["image", "label"], "label", [8, 8, 8], pos=1, neg=0, num_samples=2)
    crop.set_random_state(0)
    return DataLoader(Dataset(items, transform=crop), batch_size=len(items))


def test_volume_stats_travel_with_the_crops_into_the_batch():
    """``VolumeStatsd`` before a MONAI random crop: every patch of the batch carries its volume's min, max and mean;
    without it the batch carries none."""
    volumes = [_volume(7), _volume(8) * 3 - 2]
    batch = next(iter(_stats_batches(volumes)))
    stats = batch_volume_stats(batch)
    assert stats is not None and set(stats) == {"min", "max", "mean"}
    assert [len(v) for v in stats.values()] == [4, 4, 4]  # 2 volumes x 2 crops, in order
    for i, volume in enumerate(volumes):
        for k in (2 * i, 2 * i + 1):
            assert stats["min"][k].item() == pytest.approx(volume.min().item())
            assert stats["max"][k].item() == pytest.approx(volume.max().item())
            assert stats["mean"][k].item() == pytest.approx(volume.mean().item(), abs=1e-6)
    assert batch_volume_stats(next(iter(_stats_batches(volumes, with_stats=False)))) is None


def test_unequal_volume_stats_are_an_error_naming_the_key():
    meta = {"volume_min": torch.zeros(2), "volume_max": torch.ones(3), "volume_mean": torch.zeros(2)}
    with pytest.raises(ValueError, match="image_meta_dict: volume statistics of unequal lengths"):
        batch_volume_stats({"image": torch.zeros(2, 1, 4, 4, 4), "image_meta_dict": meta})


def _spy_apply(monkeypatch, module) -> list:
    calls = []
    real = module.apply_tea_ops

    def spy(ops, x, what="image", stats=None):
        if what == "image":
            calls.append(stats)
        return real(ops, x, what, stats)

    monkeypatch.setattr(module, "apply_tea_ops", spy)
    return calls


@pytest.mark.parametrize("estimator", ["paired", "gumbel"])
@pytest.mark.parametrize("score", ["alone", "ensemble"])
def test_the_tea_updater_gives_each_patchs_copies_its_volume_stats(monkeypatch, estimator, score):
    """The copies of a validation patch are transformed with its own volume's statistics, one row per copy (both
    estimators, the ensemble score too); a loader without them gives none."""
    volumes = [_volume(9), _volume(10) + 100.0]  # disjoint ranges: a patch lies in its own volume's range only
    net = torch.nn.Conv3d(1, 2, 1)
    for with_stats in (True, False):
        calls, images = _spy_apply(monkeypatch, tea_updater_module), []
        loader = _stats_batches(volumes, with_stats)
        updater = TEAPolicyUpdater(make_tea_policy("nnunet"), net, loader, lr=0.01, num_copies=3, patches=4,
                                   estimator=estimator, op_score=score, tta_z=2)  # fmt: skip
        monkeypatch.setattr(updater, "_foreground_patches", _recording(updater._foreground_patches, images))
        engine = Engine(lambda e, b: None)
        updater.attach(engine)
        engine.run([0], max_epochs=1)
        assert updater.updates == 1 and len(calls) == len(images) == 4  # one batched call per patch
        if not with_stats:
            assert calls == [None] * 4
            continue
        for call, image in zip(calls, images):
            assert call is not None and {len(v) for v in call.values()} == {len(call["min"])} and len(call["min"]) >= 3
            assert all(bool((v == v[0]).all()) for v in call.values())  # every copy of a patch: its volume's
            assert float(call["min"][0]) <= float(image.min()) and float(image.max()) <= float(call["max"][0])
        assert {float(call["min"][0]) > 50 for call in calls} == {True, False}  # patches of both volumes


def _recording(foreground_patches, images: list):
    def record(count):
        patches = foreground_patches(count)
        images.extend(patch[0] for patch in patches)
        return patches

    return record


def test_the_tra_updaters_tea_transformed_validation_batch_reads_the_volume_stats(monkeypatch):
    """Joint mode's validation batch under TEA ops (``tra_val_tea``) is transformed with its volumes' statistics."""
    calls = _spy_apply(monkeypatch, tra_updater_module)
    volumes = [_volume(11), _volume(12) + 2.0]
    batch = next(iter(_stats_batches(volumes)))
    policy = CategoricalPolicy([84])
    chunks = tra_updater_module.tea_transform_batch(batch["image"], batch["label"], policy,
                                                    [get_tea_op(i) for i in range(84)], torch.Generator(),
                                                    batch_volume_stats(batch))  # fmt: skip
    assert sum(len(x) for x, _ in chunks) == 4
    assert calls[0] is not None and torch.equal(calls[0]["min"], batch_volume_stats(batch)["min"])


def test_the_tra_updaters_validation_gradient_gives_the_tea_ops_the_batchs_volume_stats(monkeypatch):
    """In joint mode the TRA update's validation batch goes through TEA ops with its volumes' statistics."""
    from jcsaug.engine import TRAPolicyUpdater
    from jcsaug.policy import make_tra_policy

    calls = _spy_apply(monkeypatch, tra_updater_module)
    loader = _stats_batches([_volume(13), _volume(14) * 2])
    net = torch.nn.Conv3d(1, 2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    updater = TRAPolicyUpdater(make_tra_policy("nnunet", 2), net, loader, opt, tea_policy=make_tea_policy())
    updater._validation_gradient()
    expected = batch_volume_stats(next(iter(loader)))
    assert len(calls) == 1 and calls[0] is not None
    assert all(torch.equal(calls[0][k], expected[k]) for k in expected)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("volume_stats")
    small_dataset(root)
    return root / "data"


@pytest.mark.filterwarnings(SMALL_DATASET_KEPT)
@pytest.mark.parametrize(("value", "expected"), [(None, False), ("false", False), ("true", True)])
def test_the_synthetic_bundles_tea_volume_stats_reach_the_validation_batches(monkeypatch, tmp_path, synthetic,
                                                                            value, expected):  # fmt: skip
    """``tea_volume_stats`` (a flag; off in the synthetic bundle, whose TEA scores whole volumes): on, the TEA's and
    the TRA's validation patches carry their volumes' statistics."""
    overrides = {"tea_patch_size": [16, 16, 16]} | ({} if value is None else {"tea_volume_stats": value})
    parser = _workflow(monkeypatch, tmp_path, synthetic, **overrides).parser
    for loader in ("tea_val_loader", "val_loader"):
        stats = batch_volume_stats(next(iter(parser.get_parsed_content(loader))))
        assert (stats is not None) is expected, loader
    if expected:
        volumes = parser.get_parsed_content("val_volumes")
        minima = sorted(float(np.min(np.asarray(v["image"]))) for v in volumes)
        assert all(any(float(m) == pytest.approx(v) for v in minima) for m in stats["min"])


def test_the_dataset_bundles_give_the_tea_its_volumes_stats_by_default(prepared, tmp_path):
    """The dataset bundles (their TEA scores training-size patches) record the volume statistics before the padding
    and the crop; ``--tea_volume_stats false`` records none."""
    data = str(prepared["kits19_tumor"][1])
    on = bundle_parser("kits19_tumor", dataset_dir=data, output_dir=str(tmp_path / "a"))
    assert on["tea_volume_stats"] is True
    names = [type(t).__name__ for t in on.get_parsed_content("val_transforms").transforms]
    assert names.index("VolumeStatsd") < names.index("BorderPadd")
    loader = on.get_parsed_content("val_loader")
    stats = batch_volume_stats(next(iter(loader)))
    assert stats is not None and len(stats["min"]) == loader.batch_size * on.get_parsed_content("val_samples_per_case")
    off = bundle_parser("kits19_tumor", dataset_dir=data, output_dir=str(tmp_path / "b"), tea_volume_stats="false")
    assert batch_volume_stats(next(iter(off.get_parsed_content("val_loader")))) is None
