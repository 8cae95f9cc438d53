"""The TEA's copies scored on the voxels their ops kept in view (``mask_out_of_view``, the reference's mask)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jcsaug.engine import AugmentationSetup, TEAPolicyUpdater
from jcsaug.engine.tea_updater import hard_dice_loss, soft_dice_loss
from jcsaug.ops.resample import resample
from jcsaug.ops.tea import TEA_OPS, get_tea_op, in_view_masks
from jcsaug.policy import CategoricalPolicy

LOSSLESS = [
    "identity",
    "mirror_sagittal",
    "rotate_frontal_acw_90",
    "rotate_longitudinal_180",
    "gamma_expand_0.5",
    "noise_0.125",
]


@pytest.mark.parametrize("name", ["scale_up_0.45", "scale_up_0.15", "rotate_frontal_acw_25", "rotate_sagittal_cw_15"])
def test_in_view_masks_are_where_the_inverse_reads_the_transformed_volume(name):
    """A mask is 1 exactly where the op's inverse, resampling with zeros padding, reads the transformed volume's own
    voxels (a ones volume stays 1 there and becomes 0 where only padding is read), on a non-cubic grid too."""
    op = get_tea_op(name)
    for size in ((20, 20, 20), (18, 22, 12)):
        (mask,) = in_view_masks([op], size)
        assert mask.shape == (1, *size) and mask.dtype == torch.bool
        read = resample(torch.ones(1, 1, *size), None, "nearest", "zeros", grid=op.grid(size, "cpu", inverse=True))
        assert torch.equal(mask, read[0] > 0.5)
        assert 0 < mask.float().mean() < 1


def test_in_view_masks_keep_the_centre_a_zoom_in_kept():
    """A zoom in by 1.45 keeps the central 1 / 1.45 of each axis in view, about a third of the voxels."""
    (mask,) = in_view_masks([get_tea_op("scale_up_0.45")], (64, 64, 64))
    assert mask.float().mean().item() == pytest.approx(1.45**-3, abs=0.01)
    assert mask[0, 32, 32, 32] and not mask[0, 0, 0, 0] and not mask[0, 63, 32, 32]
    (mask,) = in_view_masks([get_tea_op("scale_down_0.45")], (64, 64, 64))  # a zoom out reads inside: all in view
    assert bool(mask.all())


@pytest.mark.parametrize("name", LOSSLESS)
def test_in_view_masks_of_ops_that_lose_no_voxel_are_everywhere(name):
    (mask,) = in_view_masks([get_tea_op(name)], (12, 16, 12))
    assert mask.shape == (1, 12, 16, 12) and bool(mask.all())


def test_in_view_masks_refuse_a_grid_that_is_not_3d():
    with pytest.raises(ValueError, match="spatial_size must have 3 entries"):
        in_view_masks([TEA_OPS[1]], (16, 16))


def test_masked_dice_losses_count_the_masked_voxels_only():
    """The masked soft and hard Dice losses equal the plain ones on the masked sub-volume."""
    torch.manual_seed(0)
    label = (torch.rand(2, 1, 8, 8, 8) > 0.6).float()
    logits = torch.randn(2, 2, 8, 8, 8) + 2 * torch.cat([-label, label], 1)
    mask = torch.zeros(2, 1, 8, 8, 8, dtype=torch.bool)
    mask[:, :, 2:6, 1:7, 3:8] = True
    inner = (slice(None), slice(None), slice(2, 6), slice(1, 7), slice(3, 8))
    probs = torch.softmax(logits, 1)
    torch.testing.assert_close(soft_dice_loss(probs, label, mask), soft_dice_loss(probs[inner], label[inner]))
    torch.testing.assert_close(hard_dice_loss(logits, label, mask), hard_dice_loss(logits[inner], label[inner]))
    assert not torch.allclose(soft_dice_loss(probs, label), soft_dice_loss(probs[inner], label[inner]))


class _Threshold(nn.Module):
    """A fixed per-voxel 'network': logits of the foreground +-6 (x - 1/2)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([-6 * (x - 0.5), 6 * (x - 0.5)], dim=1)


def _corner_lesion_patch() -> tuple[torch.Tensor, torch.Tensor]:
    """A lesion at the centre and one in a corner: a zoom in by 1.45 keeps the first in view and loses the second."""
    label = torch.zeros(1, 24, 24, 24)
    label[0, 9:15, 9:15, 9:15] = 1
    label[0, 0:4, 0:4, 0:4] = 1
    return label.clone(), label


@pytest.mark.parametrize("score", ["alone", "alone-logits", "alone-hard", "with-identity", "with-identity-hard"])
def test_a_masked_score_ignores_what_the_op_moved_out_of_view(score):
    """``mask_out_of_view``: a zoom in that segments what it kept in view scores (nearly) as the untouched copy does;
    without the mask it is charged with the corner lesion it never saw. Ops that lose no voxel score alike."""
    image, label = _corner_lesion_patch()
    policy = CategoricalPolicy([len(TEA_OPS)]).double()
    zoom, mirror = get_tea_op("scale_up_0.45"), get_tea_op("mirror_sagittal")

    def scores(masked: bool) -> torch.Tensor:
        updater = TEAPolicyUpdater(policy, _Threshold(), [], num_copies=2, op_score=score, mask_out_of_view=masked)
        return updater._mapped_back_dice(image, label, [zoom, mirror])

    plain, masked = scores(False), scores(True)
    assert plain[0] == masked[0] and plain[2] == masked[2]  # the untouched copy and the mirror: every voxel in view
    assert masked[1] <= plain[1]
    if score.startswith("alone"):  # (in the pair, the untouched copy's half still sees the corner)
        assert plain[1] - plain[0] > 0.1  # the corner lesion, lost to the zoom, counts against it
        # on what it kept the zoom nearly matches the untouched copy (its interpolations soften the lesion's border)
        assert masked[1] - masked[0] < (plain[1] - plain[0]) / 2
    # the masked score is the score on the zoom's own in-view voxels
    (in_view,) = in_view_masks([zoom], label.shape[1:])
    updater = TEAPolicyUpdater(policy, _Threshold(), [], num_copies=1, op_score=score)
    mapped = updater._mapped_back_predictions(image, [zoom], logits=score != "alone")[1]
    if score.startswith("with-identity"):
        mapped = (mapped + _Threshold()(image[None])[0]) / 2
    if score.endswith("-hard"):
        expected = hard_dice_loss(mapped[None], label[None], in_view[None])
    else:
        expected = soft_dice_loss(mapped[None] if score == "alone" else torch.softmax(mapped[None], 1), label[None],
                                  in_view[None])  # fmt: skip
    torch.testing.assert_close(masked[1:2], expected.double().cpu(), rtol=1e-5, atol=1e-7)


class _CentreThreshold(_Threshold):
    """A network without padding, as DeepMedic: it segments the centre of its input, 2 voxels in from each side."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[..., 2:-2, 2:-2, 2:-2]


@pytest.mark.parametrize("score", ["alone", "alone-hard", "ensemble"])
def test_a_network_that_segments_the_centre_is_masked_on_its_own_grid(score):
    """The prediction (and the label) of a network without padding cover the patch's centre: the mask is computed on
    that grid, where the inverse reads the op's prediction (a DeepMedic bundle run once failed on the patch's grid)."""
    image, label = _corner_lesion_patch()
    centre = label[:, 2:-2, 2:-2, 2:-2]
    policy = CategoricalPolicy([len(TEA_OPS)]).double()
    zoom, mirror = get_tea_op("scale_up_0.45"), get_tea_op("mirror_sagittal")
    updater = TEAPolicyUpdater(policy, _CentreThreshold(), [], num_copies=2, op_score=score, tta_z=3,
                               mask_out_of_view=True)  # fmt: skip
    masked = updater._mapped_back_dice(image, centre, [zoom, mirror])
    plain = TEAPolicyUpdater(policy, _CentreThreshold(), [], num_copies=2, op_score=score, tta_z=3)._mapped_back_dice(
        image, centre, [zoom, mirror])  # fmt: skip
    assert masked[0] == plain[0] and masked[2] == plain[2] and masked[1] < plain[1]
    if score == "alone":
        (in_view,) = in_view_masks([zoom], centre.shape[1:])
        mapped = updater._mapped_back_predictions(image, [zoom], logits=False)[1]
        expected = soft_dice_loss(mapped[None], centre[None], in_view[None]).double()
        torch.testing.assert_close(masked[1:2], expected, rtol=1e-5, atol=1e-7)


def test_a_masked_ensemble_score_counts_an_ops_change_where_it_kept_the_view():
    """``op_score="ensemble"``: op k's first-order change ``g . (l_k - l_0)`` is summed over its in-view voxels."""
    image, label = _corner_lesion_patch()
    policy = CategoricalPolicy([len(TEA_OPS)]).double()
    zoom, mirror = get_tea_op("scale_up_0.45"), get_tea_op("mirror_sagittal")

    def scores(masked: bool) -> torch.Tensor:
        updater = TEAPolicyUpdater(policy, _Threshold(), [], num_copies=2, op_score="ensemble", tta_z=3,
                                   mask_out_of_view=masked)  # fmt: skip
        return updater._mapped_back_dice(image, label, [zoom, mirror])

    plain, masked = scores(False), scores(True)
    assert plain[0] == masked[0] and plain[2] == masked[2]
    assert masked[1] < plain[1]  # the lost corner no longer counts against the zoom


def test_the_mask_setting_reaches_both_tea_learners_and_a_resume_keeps_it(monkeypatch):
    """``tea_mask_out_of_view``: the TEA learned in joint mode and post hoc masks; a checkpoint records it, on or off (a
    run from before the setting masked nothing: the resume check assumes off for it)."""
    from helpers import spy_posthoc_tea_updater

    seen = spy_posthoc_tea_updater(monkeypatch)
    image, label = _corner_lesion_patch()
    batch = [{"image": image[None], "label": label[None]}]
    AugmentationSetup("heuristic", "learned-posthoc", tea_mask_out_of_view=True).test_tea_policy(
        _Threshold(), batch, posthoc_iterations=1, num_copies=2
    )
    assert seen["mask_out_of_view"] is True
    optimiser = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    tea = AugmentationSetup("heuristic", "joint", tea_mask_out_of_view=True).updaters(_Threshold(), optimiser, []).tea
    assert tea.mask_out_of_view and tea.resume_settings()["mask_out_of_view"] is True
    plain = AugmentationSetup("heuristic", "joint").updaters(_Threshold(), optimiser, []).tea
    assert not plain.mask_out_of_view and plain.resume_settings()["mask_out_of_view"] is False
