"""The TEA's op scores pooled over a foreground-centred patch and background-centred ones (``background_patches``,
the bundles' ``tea_background_patches``)."""

from __future__ import annotations

import pytest
import torch
from ignite.engine import Engine
from torch import nn

from helpers import SMALL_DATASET_KEPT, small_dataset, spy_posthoc_tea_updater
from jcsaug.engine import AugmentationSetup, TEAPolicyUpdater
from jcsaug.engine.preflight import PreflightError, check_settings
from jcsaug.engine.tea_updater import soft_dice_loss
from jcsaug.ops.tea import TEA_OPS, get_tea_op
from jcsaug.policy import CategoricalPolicy
from jcsaug.policy.transforms import centre_class
from test_bundle_hardening import _workflow
from test_tea_in_view import _Threshold  # the same fixed per-voxel 'network'


def _lesion_patch() -> tuple[torch.Tensor, torch.Tensor]:
    """A bright lesion (2.0) at the centre on a dark background (-1.0): segmented with or without a shift by 0.25."""
    label = torch.zeros(1, 12, 12, 12)
    label[0, 4:8, 4:8, 4:8] = 1
    return 3.0 * label - 1.0, label


def _background_patch() -> tuple[torch.Tensor, torch.Tensor]:
    """No lesion, but a faint blob (0.7) the threshold network calls foreground: a false positive that a shift of
    -0.25 removes."""
    image = torch.full((1, 12, 12, 12), -1.0)
    image[0, 1:5, 1:5, 1:5] = 0.7
    return image, torch.zeros(1, 12, 12, 12)


def _updater(batches, **kwargs) -> TEAPolicyUpdater:
    ops = [TEA_OPS[0], get_tea_op("shift_sub_0.25"), get_tea_op("shift_add_0.25")]
    return TEAPolicyUpdater(CategoricalPolicy([len(ops)]), _Threshold(), batches, lr=0.1, num_copies=2, ops=ops,
                            **kwargs)  # fmt: skip


def test_an_op_that_removes_false_positives_away_from_the_lesion_is_credited_only_with_background_patches():
    """On the lesion patch alone a shift down changes nothing; pooled with a background patch whose false positive
    it removes, it lowers the Dice loss, and a shift up (more false positives) raises it."""
    (image, label), background = _lesion_patch(), _background_patch()
    updater = _updater([])
    ops = updater.ops[1:]
    alone = updater._mapped_back_dice(image, label, ops)
    pooled = updater._mapped_back_dice(image, label, ops, None, [(*background, None)])
    assert alone[1] == pytest.approx(float(alone[0]), abs=1e-3)  # the lesion is segmented either way
    assert pooled[1] < pooled[0] - 0.05 < pooled[2] - 0.05  # down removes the false positive, up makes it larger
    assert pooled[0] > alone[0] + 0.05  # the false positive counts against the untouched copy too


@pytest.mark.parametrize("score", ["alone", "alone-logits", "with-identity", "alone-hard", "with-identity-hard"])
def test_the_pooled_score_is_one_dice_over_the_patches_side_by_side(score):
    """Every pooled score equals the same score of one patch made of the patches side by side (a Dice's voxel sums
    run over all of them)."""
    (image, label), (bg_image, bg_label) = _lesion_patch(), _background_patch()
    updater = _updater([], op_score=score)
    ops = updater.ops[1:]
    pooled = updater._mapped_back_dice(image, label, ops, None, [(bg_image, bg_label, None)])
    joined = updater._mapped_back_dice(torch.cat([image, bg_image], -1), torch.cat([label, bg_label], -1), ops)
    torch.testing.assert_close(pooled, joined, atol=1e-6, rtol=0)


def test_a_pooled_soft_dice_is_the_soft_dice_of_the_joined_probabilities():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(2, 2, 6, 6, 12), 1)
    labels = (torch.rand(2, 1, 6, 6, 12) > 0.7).float()
    halves = [soft_dice_loss(probs[..., :6], labels[..., :6]), soft_dice_loss(probs[..., 6:], labels[..., 6:])]
    assert not torch.allclose(soft_dice_loss(probs, labels), (halves[0] + halves[1]) / 2)  # pooled is not the mean


def test_the_patches_of_an_update_each_get_their_own_background_patches():
    """``_foreground_patches``: each foreground-centred patch with ``background_patches`` background-centred ones
    of the stream (none shared); with 0, none and the stream read as before."""
    (image, label), (bg_image, bg_label) = _lesion_patch(), _background_patch()
    batches = [{"image": torch.stack([bg_image, (image + 1) * k, bg_image + k]), "label": torch.stack([bg_label, label,
                                                                                                  bg_label])}
               for k in (1.0, 2.0, 3.0)]  # fmt: skip
    updater = _updater(batches, patches=2, background_patches=2)
    patches = updater._foreground_patches(2)
    assert [float(p[0].max()) for p in patches] == [3.0, 6.0]
    backgrounds = [[float(b[0].max()) for b in p[3]] for p in patches]
    assert backgrounds == [pytest.approx([0.7, 1.7]), pytest.approx([0.7, 2.7])]  # in stream order, each its own
    assert all(centre_class(b[1]) == 0 for p in patches for b in p[3])
    plain = _updater(batches, patches=2)
    assert [len(p[3]) for p in plain._foreground_patches(2)] == [0, 0]


@pytest.mark.parametrize("estimator", ["paired", "gumbel"])
def test_updates_with_background_patches_step_the_policy(estimator):
    (image, label), (bg_image, bg_label) = _lesion_patch(), _background_patch()
    batches = [{"image": torch.stack([image, bg_image]), "label": torch.stack([label, bg_label])}]
    updater = _updater(batches, background_patches=1, estimator=estimator)
    before = updater.policy.logits.detach().clone()
    engine = Engine(lambda e, b: None)
    updater.attach(engine)
    engine.run([0] * 3, max_epochs=1)
    assert updater.updates == 3 and not torch.equal(before, updater.policy.logits.detach())
    if estimator == "paired":  # the shift down, credited with the false positive it removes, gains on the shift up
        logits = updater.policy.logits.detach()[0]
        assert logits[1] > logits[2]


def test_bad_background_patch_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="background_patches must be >= 0"):
        _updater([], background_patches=-1)
    with pytest.raises(ValueError, match="background_patches needs an op_score other than 'ensemble'"):
        _updater([], background_patches=1, op_score="ensemble", tta_z=2)
    with pytest.raises(ValueError, match="tea_background_patches must be >= 0"):
        AugmentationSetup("heuristic", "joint", tea_background_patches=-2)
    with pytest.raises(PreflightError, match="--tea_background_patches 1: tea_op_score 'ensemble' scores"):
        check_settings([], tea_mode="joint", tea_background_patches=1, tea_op_score="ensemble")
    with pytest.raises(PreflightError, match="--tea_background_patches -1: must be"):
        check_settings([], tea_background_patches=-1)


def test_the_setting_reaches_both_tea_learners_and_a_resume_keeps_it(monkeypatch):
    seen = spy_posthoc_tea_updater(monkeypatch)
    image, label = _lesion_patch()
    batch = [{"image": image[None], "label": label[None]}]
    AugmentationSetup("heuristic", "learned-posthoc", tea_background_patches=2).test_tea_policy(
        _Threshold(), batch, posthoc_iterations=1, num_copies=2
    )
    assert seen["background_patches"] == 2
    optimiser = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    tea = AugmentationSetup("heuristic", "joint", tea_background_patches=1).updaters(_Threshold(), optimiser, []).tea
    assert tea.background_patches == 1 and tea.resume_settings()["background_patches"] == 1
    plain = AugmentationSetup("heuristic", "joint").updaters(_Threshold(), optimiser, []).tea
    assert plain.background_patches == 0 and plain.resume_settings()["background_patches"] == 0


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("background_patches")
    small_dataset(root)
    return root / "data"


@pytest.mark.filterwarnings(SMALL_DATASET_KEPT)
@pytest.mark.parametrize(("value", "expected"), [(None, 0), (2, 2)])
def test_the_synthetic_bundle_draws_the_teas_background_patches(monkeypatch, tmp_path, synthetic, value, expected):
    """``tea_background_patches`` reaches the TEA updater, and the TEA's crop draws background-centred patches in
    that ratio to lesion-centred ones (none by default)."""
    overrides = {"tea_patch_size": [16, 16, 16]} | ({} if value is None else {"tea_background_patches": value})
    parser = _workflow(monkeypatch, tmp_path, synthetic, **overrides).parser
    assert parser.get_parsed_content("policy_updaters").tea.background_patches == expected
    crop = parser.get_parsed_content("tea_crop")
    assert (crop.cropper.pos_ratio if hasattr(crop, "cropper") else crop.pos_ratio) == pytest.approx(1 / (1 + expected))
    if expected:
        tea = parser.get_parsed_content("policy_updaters").tea
        patches = tea._foreground_patches(1)
        assert len(patches[0][3]) == expected
