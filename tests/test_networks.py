"""DeepMedic geometry, fields of view and gradients; valid-conv tiling; the network factory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from monai.networks.nets import UNETR, DynUNet, SwinUNETR

from jcsaug.engine.losses import main_output
from jcsaug.networks import (
    NETWORKS,
    DeepMedic,
    NnUNetDynUNet,
    ValidConvSlidingWindowInferer,
    crop_label_to_output,
    deep_supervision_weights,
    make_network,
    network_patch_sizes,
    nnunet_kernels_strides,
    split_deep_supervision,
)
from jcsaug.networks.deepmedic import _add_residual

pytestmark = pytest.mark.usefixtures("single_thread")


TINY = {"feature_maps": (4,) * 8, "fc_feature_maps": (6, 6)}

#: torch's check of MONAI's DynUNet warns on its `heads: list[torch.Tensor]` (torch reads lowercase `list` as empty)
SCRIPT_WARNING = "ignore:The TorchScript type system doesn't support instance-level annotations:UserWarning"


def tiny_deepmedic(**kwargs) -> DeepMedic:
    torch.manual_seed(0)
    return DeepMedic(1, 3, **{**TINY, **kwargs}).eval()


def reflect_pad(x: torch.Tensor, margin: int, extra: tuple[int, ...] = (0, 0, 0)) -> torch.Tensor:
    pads = [(0, 0), (0, 0)] + [(margin, margin + e) for e in extra]
    return torch.as_tensor(np.pad(x.numpy(), pads, mode="reflect"))


def test_default_deepmedic_geometry_matches_reference_numbers():
    net = DeepMedic(1, 3).eval()
    assert net.segment_size == (37,) * 3 and net.output_size == (21,) * 3 and net.input_size == (109,) * 3
    assert net.output_size_for(109) == (21,) * 3 and net.input_size_for((21, 21, 21)) == (109,) * 3
    assert net.receptive_fields == {"normal": 17, "x3": 51, "x5": 85}
    seen = {}
    hooks = [
        p.blocks[0].register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(k, (i[0].shape[2:], o.shape[1])))
        for k, p in [("normal", net.normal), ("x3", net.context[0]), ("x5", net.context[1])]
    ]
    with torch.no_grad():
        out = net(torch.randn(1, 1, 109, 109, 109))
    for h in hooks:
        h.remove()
    assert out.shape == (1, 3, 21, 21, 21)
    # pathway inputs as in DeepMedic's default config: 37³ normal, 23³ (×3 of 69³), 21³ (×5 of 105³)
    assert {k: tuple(v[0]) for k, v in seen.items()} == {"normal": (37,) * 3, "x3": (23,) * 3, "x5": (21,) * 3}
    assert net.fc[0].conv.in_channels == 150 and net.fc[0].conv.kernel_size == (3, 3, 3)
    assert [b.conv.out_channels for b in net.normal.blocks] == [30, 30, 40, 40, 40, 40, 50, 50]
    with pytest.raises(ValueError, match="too small"):
        net.output_size_for(88)


def test_deepmedic_variants_shapes():
    orig = DeepMedic.original(2, 2, **TINY).eval()
    assert orig.output_size == (9,) * 3 and orig.input_size == (61,) * 3
    strided = tiny_deepmedic(subsample_mode="strided", segment_size=(21, 23, 25))
    anis = torch.randn(2, 1, *strided.input_size)
    with torch.no_grad():
        assert orig(torch.randn(1, 2, 61, 61, 61)).shape == (1, 2, 9, 9, 9)
        assert strided(anis).shape == (2, 3, 5, 7, 9)
        # any input larger than 2·margin works: output = input - 2·margin
        assert strided(torch.randn(1, 1, 90, 91, 92)).shape == (1, 3, 2, 3, 4)
    net2d = DeepMedic(1, 2, segment_size=25, spatial_dims=2, **TINY).eval()
    assert net2d(torch.randn(1, 1, *net2d.input_size)).shape == (1, 2, 9, 9)
    with pytest.raises(ValueError, match="odd"):
        DeepMedic(1, 2, subsample_factors=(2,))


@pytest.mark.parametrize("mode", ["strided", "avg"])
def test_context_pathways_widen_the_field_of_view(mode):
    net = tiny_deepmedic(segment_size=25, subsample_mode=mode)  # output 9³, input 97³: normal 25³, ×3 57³, ×5 95³
    assert net.input_size == (97,) * 3
    x = torch.randn(1, 1, 97, 97, 97)
    with torch.no_grad():
        ref = net(x)

        def changed(index: tuple[int, int, int]) -> float:
            y = x.clone()
            y[(0, 0, *index)] += 5.0
            return (net(y) - ref).abs().max().item()

        c = 48
        assert changed((c, c, c)) > 1e-4  # centre: every pathway
        # just outside the normal 25³ crop (voxels 36..60), inside the ×3 context; strided: on the ×3 grid c ± 3k
        assert changed((c - 13 if mode == "avg" else c - 15, c, c)) > 1e-4
        assert changed((c, c + 45, c)) > 1e-4  # only inside the ×5 context (95³ crop = voxels 1..95), on its grid
        # strided: every f-th voxel, no smoothing (the reference sampler): a voxel between the ×5 grid's is not read
        assert (changed((c, c + 44, c)) == 0.0) == (mode == "strided")
        assert changed((0, c, c)) == 0.0  # outside every pathway's field of view
        assert changed((c, c, 96)) == 0.0
    assert tiny_deepmedic(segment_size=25, subsample_factors=()).input_size == (25,) * 3


def test_gradients_reach_every_pathway():
    net = tiny_deepmedic(segment_size=23).train()
    x = torch.randn(2, 1, *net.input_size, requires_grad=True)
    out = net(x)
    label = torch.randint(0, 3, (2, *net.output_size))
    F.cross_entropy(out, label).backward()
    first_convs = [net.normal.blocks[0].conv, *(p.blocks[0].conv for p in net.context), net.fc[0].conv]
    for conv in first_convs:
        assert conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0
    assert x.grad is not None and x.grad[0, 0, 2, 47, 47].abs() > 0  # a ×5-only voxel (on the ×5 grid) gets gradient


def test_crop_label_to_output_and_residual():
    lab = torch.arange(109**3).reshape(1, 1, 109, 109, 109)
    crop = crop_label_to_output(lab, 21)
    assert torch.equal(crop, lab[..., 44:65, 44:65, 44:65])
    arr = np.arange(10 * 9 * 8).reshape(10, 9, 8)
    assert np.array_equal(crop_label_to_output(arr, (4, 5, 6)), arr[3:7, 2:7, 1:7])
    assert crop_label_to_output(arr, (10, 9, 8)) is arr
    net = tiny_deepmedic()
    assert torch.equal(net.crop_to_output(lab), crop)
    with pytest.raises(ValueError):
        crop_label_to_output(arr, (11, 9, 8))
    out, skip = torch.ones(1, 4, 3, 3, 3), torch.arange(2 * 125.0).reshape(1, 2, 5, 5, 5)
    res = _add_residual(out, skip)
    assert torch.equal(res[:, :2], 1 + skip[..., 1:4, 1:4, 1:4]) and torch.equal(res[:, 2:], out[:, 2:])


@pytest.mark.parametrize(("mode", "spatial_dims", "layout"), [
    ("strided", 3, {}), ("avg", 3, {"subsample_factors": (3,), "residual_layers": (), "fc_residual_layers": ()}),
    ("strided", 2, {"subsample_factors": ()})])  # fmt: skip
def test_deepmedic_scripts_and_the_script_takes_any_input_size(mode, spatial_dims, layout):
    """``torch.jit.script`` (MONAI's ``ckpt_export`` without ``--use_trace``) compiles DeepMedic, with or without
    residuals and context pathways; the scripted network predicts what the eager one predicts at every input size (a
    trace would keep the size it was traced at) and refuses one too small as the eager one does."""
    net = tiny_deepmedic(subsample_mode=mode, spatial_dims=spatial_dims, **layout)
    scripted = torch.jit.script(net)
    margin = net.margin
    for out in (1, 7, 12):
        x = torch.randn(2, 1, *(out + 2 * margin,) * spatial_dims)
        with torch.no_grad():
            expected = net(x)
            torch.testing.assert_close(scripted(x), expected, rtol=0, atol=0)
        assert tuple(expected.shape[2:]) == (out,) * spatial_dims
    with pytest.raises(torch.jit.Error, match="too small for DeepMedic"):
        scripted(torch.randn(1, 1, *(2 * margin,) * spatial_dims))


def test_valid_sliding_window_stitches_exactly_for_a_fully_valid_net():
    # normal pathway + 1³ FC layers only: translation-equivariant, so tiling must equal one big forward
    net = tiny_deepmedic(subsample_factors=(), fc_kernel_sizes=(1, 1), segment_size=21)
    inferer = ValidConvSlidingWindowInferer.for_network(net, sw_batch_size=3)
    assert inferer.roi_size == (21,) * 3 and inferer.output_size == (5,) * 3 and inferer.margin == (8,) * 3
    x = torch.randn(2, 1, 12, 17, 9)
    with torch.no_grad():
        out = inferer(x, net)
        direct = net(reflect_pad(x, 8))
    assert out.shape == (2, 3, 12, 17, 9)
    torch.testing.assert_close(out, direct, rtol=1e-4, atol=1e-5)


def test_valid_sliding_window_with_context_pathways():
    net = tiny_deepmedic()
    inferer = ValidConvSlidingWindowInferer.for_network(net, output_size=7, sw_batch_size=4)
    m = net.margin
    assert inferer.roi_size == (7 + 2 * m,) * 3
    with torch.no_grad():
        one = torch.randn(1, 1, 7, 7, 7)  # exactly one window
        torch.testing.assert_close(inferer(one, net), net(reflect_pad(one, m)), rtol=1e-4, atol=1e-5)
        x = torch.randn(2, 1, 10, 16, 7)  # non-multiple sizes: tiles start at (0, 3) × (0, 7, 9) × (0,)
        out = inferer(x, lambda t: [net(t)])  # list outputs: first head is used
        assert out.shape == (2, 3, 10, 16, 7)
        padded = reflect_pad(x, m)
        roi = inferer.roi_size[0]
        # later tiles overwrite overlaps (shifted border tiles at 3 and 9): compare the voxels each tile keeps
        for s0, s1, k0, k1 in [(0, 0, 3, 7), (0, 7, 3, 2), (3, 0, 7, 7), (3, 9, 7, 7)]:
            tile = net(padded[:, :, s0 : s0 + roi, s1 : s1 + roi, :roi])
            kept = out[:, :, s0 : s0 + k0, s1 : s1 + k1, :]
            torch.testing.assert_close(kept, tile[:, :, :k0, :k1], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="even"):
        ValidConvSlidingWindowInferer(20, 7)


def test_nnunet_plan():
    kernels, strides = nnunet_kernels_strides(64)
    assert strides == [[1, 1, 1]] + [[2, 2, 2]] * 4 and kernels == [[3, 3, 3]] * 5
    kernels, strides = nnunet_kernels_strides((128, 128, 8), spacing=(1.25, 1.25, 10.0))
    assert kernels[0] == [3, 3, 1] and strides[1] == [2, 2, 1] and len(strides) == 6  # 5 in-plane pools max
    assert sum(s[2] == 2 for s in strides) == 1
    assert deep_supervision_weights(3) == pytest.approx([4 / 7, 2 / 7, 1 / 7])


def test_factory_unet3d_deep_supervision():
    torch.manual_seed(0)
    net = make_network("unet3d", 1, 2, 32, base_filters=4)
    assert isinstance(net, NnUNetDynUNet) and isinstance(net, DynUNet)
    x = torch.randn(2, 1, 32, 32, 32)
    heads = net.train()(x)
    assert isinstance(heads, tuple) and len(heads) == 2  # 3 pools → main + 1 auxiliary head
    assert all(h.shape == (2, 2, 32, 32, 32) for h in heads)
    assert main_output(heads).shape == (2, 2, 32, 32, 32)
    stacked_net = make_network("unet3d", 1, 2, 32, base_filters=4, stacked_deep_supervision=True)
    stacked_net.load_state_dict(net.state_dict())  # same parameters/keys as plain DynUNet
    stacked = stacked_net.train()(x)
    assert stacked.shape == (2, 2, 2, 32, 32, 32)  # [B, S+1, C, ...]
    assert [h.shape for h in split_deep_supervision(stacked)] == [h.shape for h in heads]
    with torch.no_grad():
        assert net.eval()(x).shape == (2, 2, 32, 32, 32)
    with pytest.raises(ValueError, match="divisible"):
        make_network("unet3d", 1, 2, (36, 32, 32))


@pytest.mark.filterwarnings(SCRIPT_WARNING)
@pytest.mark.parametrize("deep_supervision", [True, False])
def test_the_unet_scripts_as_its_inference_network(deep_supervision):
    """``torch.jit.script`` of the factory's U-Net compiles a ``DynUNet`` without the deep-supervision heads (which
    MONAI's ``DynUNet`` cannot script) holding its weights: the script predicts what the network predicts in eval
    mode, at the patch size and at another size the strides divide; the network itself keeps its heads."""
    torch.manual_seed(0)
    net = make_network("unet3d", 1, 2, 32, base_filters=4, deep_supervision=deep_supervision).eval()
    scripted = torch.jit.script(net)
    assert scripted.original_name == "DynUNet" and not scripted.training
    for size in ((32, 32, 32), (48, 32, 64)):
        x = torch.randn(1, 1, *size)
        with torch.no_grad():
            torch.testing.assert_close(scripted(x), net(x), rtol=0, atol=0)
    assert isinstance(net.train()(torch.randn(1, 1, 32, 32, 32)), tuple) == deep_supervision


def test_factory_transformers_and_deepmedic():
    pytest.importorskip("einops", reason="MONAI's SwinUNETR/UNETR need einops")
    torch.manual_seed(0)
    swin = make_network(
        "transformer", 1, 2, (64, 32, 32), feature_size=12, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=2
    )
    assert isinstance(swin, SwinUNETR)
    unetr = make_network("transformer", 1, 2, 16, hidden_size=16, mlp_dim=16, num_heads=2, feature_size=2)
    assert isinstance(unetr, UNETR)
    assert isinstance(make_network("transformer", 1, 2, 32, hidden_size=16, mlp_dim=16, num_heads=2), UNETR)  # 32³
    dm = make_network("DeepMedic", 1, 2, 21, **TINY)
    assert isinstance(dm, DeepMedic) and dm.output_size == (5,) * 3
    with torch.no_grad():
        assert swin.eval()(torch.randn(1, 1, 64, 32, 32)).shape == (1, 2, 64, 32, 32)
        assert unetr.eval()(torch.randn(1, 1, 16, 16, 16)).shape == (1, 2, 16, 16, 16)
        assert dm.eval()(torch.randn(1, 1, *dm.input_size)).shape == (1, 2, 5, 5, 5)
    with pytest.raises(ValueError, match="SwinUNETR"):
        make_network("transformer", 1, 2, (128, 128, 8))
    with pytest.raises(ValueError, match="32"):
        make_network("transformer", 1, 2, 16, kind="swinunetr")
    with pytest.raises(ValueError, match="16"):
        make_network("transformer", 1, 2, (64, 64, 24), kind="unetr")


def test_network_patch_sizes_and_unknown_name():
    assert set(NETWORKS) == {"deepmedic", "unet3d", "transformer"}
    assert network_patch_sizes("deepmedic", 37) == ((109,) * 3, (21,) * 3)
    assert network_patch_sizes("deepmedic", 37, subsample_factors=(3,)) == ((73,) * 3, (21,) * 3)
    assert network_patch_sizes("unet3d", (64, 64, 32)) == ((64, 64, 32), (64, 64, 32))
    with pytest.raises(KeyError, match="deepmedic.*transformer.*unet3d"):
        make_network("nnformer", 1, 2, 64)
    with pytest.raises(KeyError):
        network_patch_sizes("nnformer", 64)


def test_the_bundles_deepmedic_inferer_pads_with_zeros_as_training_does():
    """Training patches are cut from volumes zero-padded by the context margin (the bundles' BorderPadd): at test
    time a border voxel must see the same zeros, not a mirror of the volume."""
    from jcsaug.networks.factory import deepmedic_inferer

    net = tiny_deepmedic(segment_size=25)
    inferer = deepmedic_inferer(net, None, segment=25)  # one window's output is 9³: one window for a 9³ volume
    x = torch.randn(1, 1, 9, 9, 9)
    with torch.no_grad():
        expected = net(F.pad(x, [net.input_size[0] // 2 - 4] * 6))  # zeros around it, as BorderPadd in training
        torch.testing.assert_close(inferer(x, net), expected)


def test_deepmedic_checkpoints_keep_their_subsampling_and_older_ones_load_as_average_pooled(tmp_path):
    """The subsampling has no weights: a checkpoint records it (extra state) and a network loading it takes it; a
    checkpoint from before it was recorded was trained with the then default, average pooling."""
    from jcsaug.engine.checkpoints import load_checkpoint, save_checkpoint_atomic
    from jcsaug.engine.posthoc import learn_tea_posthoc

    pooled = tiny_deepmedic(segment_size=25, subsample_mode="avg")
    save_checkpoint_atomic(tmp_path / "c.pt", {"network": pooled})
    loaded = tiny_deepmedic(segment_size=25)
    assert loaded.subsample_mode == "strided"
    load_checkpoint(tmp_path / "c.pt", {"network": loaded})
    x = torch.randn(1, 1, *loaded.input_size)
    with torch.no_grad():
        assert loaded.subsample_mode == "avg" and torch.equal(loaded(x), pooled(x))
    legacy = {k: v for k, v in pooled.state_dict().items() if not k.endswith("_extra_state")}
    torch.save({"network": legacy}, tmp_path / "old.pt")
    old = tiny_deepmedic(segment_size=25)
    with pytest.warns(UserWarning, match="without its subsample_mode"):
        load_checkpoint(tmp_path / "old.pt", {"network": old})
    with torch.no_grad():
        assert old.subsample_mode == "avg" and torch.equal(old(x), pooled(x))
    with pytest.raises(ValueError, match="subsample_mode must be one of"):
        old.set_extra_state({"subsample_mode": "max"})
    # the post-hoc TEA's check that the frozen network stays unchanged reads only its tensors
    label = torch.zeros(1, 1, *loaded.output_size, dtype=torch.long)  # DeepMedic: labels of its output region
    label[..., 2:7, 2:7, 2:7] = 1
    learn_tea_posthoc(loaded, [{"image": x, "label": label}], iterations=1, num_copies=2, progress=False)


def test_deepmedic_batchnorm_momentum_approximates_the_references_60_batch_average():
    """DATASETS.md §7: BN inference statistics are a moving average over 60 batches; the EMA with the same mean age
    has momentum 2 / 61. It reaches every BatchNorm (also through the factory); bad values are refused."""

    def momenta(net: torch.nn.Module) -> set:
        bns = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        assert bns
        return {m.momentum for m in bns}

    assert momenta(DeepMedic(1, 2, **TINY)) == {2 / 61}
    assert momenta(DeepMedic.original(1, 2, **TINY)) == {2 / 61}
    assert momenta(DeepMedic(1, 2, bn_momentum=0.25, **TINY)) == {0.25}
    assert momenta(DeepMedic(1, 2, bn_momentum=None, **TINY)) == {None}  # PyTorch's cumulative average
    assert momenta(make_network("deepmedic", 1, 2, 21, bn_momentum=0.5, **TINY)) == {0.5}
    for bad in (0, -0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="bn_momentum"):
            DeepMedic(1, 2, bn_momentum=bad, **TINY)
    with pytest.raises(ValueError, match="bn_momentum"):  # one place for it, not silently overridden
        DeepMedic(1, 2, norm=("batch", {"momentum": 0.3}), **TINY)
