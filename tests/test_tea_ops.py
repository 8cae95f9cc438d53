"""The TEA catalogue (SPEC §3): ids, names, spatial conventions, inversion and intensity values."""

from __future__ import annotations

import math

import pytest
import torch
from monai.data import MetaTensor

from helpers import retaining_stats
from jcsaug.ops.axes import FRONTAL, LONGITUDINAL, SAGITTAL, rotation_plane
from jcsaug.ops.filters import log_sharpen
from jcsaug.ops.tea import TEA_OPS, TEAOp, get_tea_op, tea_catalogue_json

N = 32
CENTRE = (N - 1) / 2

AFFINE_OPS = [op for op in TEA_OPS if op.kind in ("scale", "rotate")]
EXACT_OPS = [op for op in TEA_OPS if op.kind in ("flip", "rot90")]
SPATIAL_OPS = [op for op in TEA_OPS if op.is_spatial]
INTENSITY_OPS = [op for op in TEA_OPS if not op.is_spatial]


pytestmark = pytest.mark.usefixtures("single_thread")


def _ids(ops: list[TEAOp]) -> list[str]:
    return [op.name for op in ops]


def _grid() -> torch.Tensor:
    """Voxel coordinates relative to the volume centre, [3, N, N, N]."""
    g = torch.stack(torch.meshgrid(*[torch.arange(N, dtype=torch.float32)] * 3, indexing="ij"))
    return g - CENTRE


def _sphere(radius: float) -> torch.Tensor:
    return ((_grid() ** 2).sum(0).sqrt() < radius).float()[None]


def _blob(offset: tuple[float, float, float], sigma: tuple[float, float, float]) -> torch.Tensor:
    off = torch.tensor(offset).view(3, 1, 1, 1)
    sig = torch.tensor(sigma).view(3, 1, 1, 1)
    return torch.exp(-0.5 * (((_grid() - off) / sig) ** 2).sum(0))[None]


def _centre_of_mass(x: torch.Tensor) -> torch.Tensor:
    """Centre of mass of a [1, N, N, N] volume relative to the volume centre."""
    w = x[0] / x[0].sum()
    return torch.stack([(w * c).sum() for c in _grid()])


# ---------------------------------------------------------------------------- catalogue
def test_catalogue_has_84_ops_in_paper_order() -> None:
    assert len(TEA_OPS) == 84
    assert [op.id for op in TEA_OPS] == list(range(84))
    assert len({op.name for op in TEA_OPS}) == 84
    json = tea_catalogue_json()
    assert [d["id"] for d in json] == list(range(84))
    assert set(json[0]) == {"id", "name", "kind", "magnitude"}


@pytest.mark.parametrize(
    ("op_id", "kind", "magnitude", "extra"),
    [
        (0, "identity", 0.0, {}),
        (1, "scale", 0.05, {"sign": -1}),
        (5, "scale", 0.45, {"sign": -1}),
        (6, "scale", 0.05, {"sign": 1}),
        (10, "scale", 0.45, {"sign": 1}),
        (11, "rotate", 5.0, {"axis": FRONTAL, "sign": 1}),
        (14, "rot90", 90.0, {"axis": FRONTAL, "sign": 1}),
        (15, "rot90", 180.0, {"axis": FRONTAL}),
        (16, "rotate", 5.0, {"axis": FRONTAL, "sign": -1}),
        (19, "rot90", 90.0, {"axis": FRONTAL, "sign": -1}),
        (20, "rotate", 5.0, {"axis": SAGITTAL, "sign": 1}),
        (24, "rot90", 180.0, {"axis": SAGITTAL}),
        (28, "rot90", 90.0, {"axis": SAGITTAL, "sign": -1}),
        (29, "rotate", 5.0, {"axis": LONGITUDINAL, "sign": 1}),
        (33, "rot90", 180.0, {"axis": LONGITUDINAL}),
        (37, "rot90", 90.0, {"axis": LONGITUDINAL, "sign": -1}),
        (38, "flip", 0.0, {"flip_axes": (SAGITTAL,)}),
        (39, "flip", 0.0, {"flip_axes": (FRONTAL,)}),
        (40, "flip", 0.0, {"flip_axes": (LONGITUDINAL,)}),
        (41, "flip", 0.0, {"flip_axes": (0, 1, 2)}),
        (42, "gamma", 0.1, {"sign": 1}),
        (47, "gamma", 0.5, {"sign": -1}),
        (48, "inverted_gamma", 0.1, {"sign": 1}),
        (53, "inverted_gamma", 0.5, {"sign": -1}),
        (54, "shift", 0.05, {"sign": 1}),
        (59, "shift", 0.25, {"sign": -1}),
        (60, "intensity_scale", 0.05, {"sign": 1}),
        (65, "intensity_scale", 0.25, {"sign": -1}),
        (66, "contrast", 0.05, {"sign": 1}),
        (71, "contrast", 0.25, {"sign": -1}),
        (72, "blur", 0.5, {}),
        (75, "sharpen", 0.9, {}),
        (77, "sharpen", 0.5, {}),
        (78, "noise", 0.025, {}),
        (80, "noise", 0.125, {}),
        (81, "low_resolution", 0.9, {}),
        (83, "low_resolution", 0.5, {}),
    ],
)
def test_spec_table_spot_checks(op_id: int, kind: str, magnitude: float, extra: dict) -> None:
    op = TEA_OPS[op_id]
    assert op.kind == kind
    assert op.magnitude == pytest.approx(magnitude)
    for field, value in extra.items():
        assert getattr(op, field) == value, (op.name, field)


def test_readable_names() -> None:
    names = [op.name for op in TEA_OPS]
    for name in (
        "identity",
        "scale_down_0.05",
        "rotate_frontal_acw_5",
        "rotate_frontal_acw_90",
        "rotate_frontal_180",
        "mirror_sagittal",
        "mirror_all",
        "gamma_expand_0.1",
        "inverted_gamma_compress_0.5",
        "shift_add_0.05",
        "shift_sub_0.05",
        "intensity_up_0.05",
        "intensity_down_0.05",
        "contrast_up_0.05",
        "contrast_down_0.05",
        "blur_0.5",
        "sharpen_0.9",
        "noise_0.025",
        "low_resolution_0.9",
    ):
        assert name in names
    assert get_tea_op("rotate_frontal_180").id == 15
    assert get_tea_op(83).name == "low_resolution_0.5"


def test_get_tea_op_errors_name_the_bad_value() -> None:
    with pytest.raises(IndexError, match=r"84.*0\.\.83"):
        get_tea_op(84)
    with pytest.raises(IndexError, match=r"-1"):
        get_tea_op(-1)
    with pytest.raises(KeyError, match="no_such_op"):
        get_tea_op("no_such_op")


@pytest.mark.parametrize("method", ["transform_image", "transform_label", "invert"])
def test_2d_input_is_rejected(method: str) -> None:
    with pytest.raises(ValueError, match=r"\(5, 6\)"):
        getattr(get_tea_op("rotate_frontal_acw_5"), method)(torch.zeros(5, 6))
    with pytest.raises(ValueError, match=r"\(5, 6\)"):
        getattr(get_tea_op("gamma_expand_0.1"), method)(torch.zeros(5, 6))


# ---------------------------------------------------------------------------- exact spatial ops
@pytest.mark.parametrize("op", EXACT_OPS, ids=_ids(EXACT_OPS))
@pytest.mark.parametrize("shape", [(2, 6, 7, 8), (3, 2, 6, 7, 8)])
def test_exact_ops_invert_exactly_on_non_cubic_volumes(op: TEAOp, shape: tuple[int, ...]) -> None:
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0))
    y = op.transform_image(x)
    assert not torch.equal(y, x)
    back = op.invert(y)
    assert back.shape == x.shape
    assert torch.equal(back, x)


@pytest.mark.parametrize("axis", [SAGITTAL, FRONTAL, LONGITUDINAL])
def test_quarter_and_half_turns_match_torch_rot90(axis: int) -> None:
    a, b = rotation_plane(axis)
    dims = (a + 1, b + 1)
    x = torch.rand(2, 6, 7, 8, generator=torch.Generator().manual_seed(1))
    name = {SAGITTAL: "sagittal", FRONTAL: "frontal", LONGITUDINAL: "longitudinal"}[axis]
    assert torch.equal(get_tea_op(f"rotate_{name}_acw_90").transform_image(x), torch.rot90(x, 1, dims))
    assert torch.equal(get_tea_op(f"rotate_{name}_cw_90").transform_image(x), torch.rot90(x, -1, dims))
    assert torch.equal(get_tea_op(f"rotate_{name}_180").transform_image(x), torch.rot90(x, 2, dims))


@pytest.mark.parametrize(
    ("name", "dims"),
    [("mirror_sagittal", [1]), ("mirror_frontal", [2]), ("mirror_axial", [3]), ("mirror_all", [1, 2, 3])],
)
def test_mirrors_flip_the_named_axes(name: str, dims: list[int]) -> None:
    x = torch.rand(2, 6, 7, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(get_tea_op(name).transform_image(x), torch.flip(x, dims))


# ---------------------------------------------------------------------------- labels
@pytest.mark.parametrize("op", SPATIAL_OPS, ids=_ids(SPATIAL_OPS))
def test_transform_label_keeps_values_and_dtype(op: TEAOp) -> None:
    label = torch.randint(0, 4, (1, 10, 11, 12), generator=torch.Generator().manual_seed(3))
    out = op.transform_label(label)
    assert out.dtype == label.dtype
    assert set(out.unique().tolist()) <= set(label.unique().tolist())
    if op.kind in ("flip", "rot90"):  # exact ops move voxels without losing any
        assert torch.equal(torch.bincount(out.flatten()), torch.bincount(label.flatten()))
        assert torch.equal(out, op.transform_image(label.float()).long())


STRONGEST_AFFINE_OPS = [op for op in AFFINE_OPS if op.magnitude in (0.45, 25.0)]


@pytest.mark.parametrize("op", STRONGEST_AFFINE_OPS, ids=_ids(STRONGEST_AFFINE_OPS))
def test_label_and_image_follow_the_same_geometry(op: TEAOp) -> None:
    # A nearest-neighbour label and the bilinear image of an off-centre ellipsoid must overlap.
    shape = _blob((4.0, -3.0, 2.0), (6.0, 4.0, 5.0)) > 0.5
    lab = op.transform_label(shape.to(torch.uint8)).bool()
    img = op.transform_image(shape.float()) > 0.5
    dice = 2 * (lab & img).sum() / (lab.sum() + img.sum())
    assert dice > 0.95, (op.name, float(dice))


def test_padding_zeros_for_labels_border_for_images() -> None:
    op = get_tea_op("scale_down_0.45")  # the content shrinks: the corners come from outside
    label = torch.full((1, 8, 9, 10), 2, dtype=torch.int64)
    out = op.transform_label(label)
    assert out[0, 0, 0, 0] == 0 and out[0, 4, 4, 5] == 2
    image = torch.full((1, 8, 9, 10), 3.0)
    torch.testing.assert_close(op.transform_image(image), image)


# ---------------------------------------------------------------------------- affine ops
@pytest.mark.parametrize("op", AFFINE_OPS, ids=_ids(AFFINE_OPS))
def test_affine_ops_invert_in_the_interior(op: TEAOp) -> None:
    # A smooth, anisotropic, off-centre Gaussian (peak 1, sigmas 5-7 voxels) on 32^3, so that
    # rotations and scalings change it. The central 12^3 region stays inside the field of view for
    # every op (the largest magnification, 1.45, keeps radii <= 10.7 voxels in view).
    # Tolerance: max |error| <= 0.04. Transform + inverse are two trilinear resamplings; their
    # error measured over all 28 ops is <= 0.030 (worst for scale_down_0.45, whose shrunken content
    # is interpolated more coarsely), while inverting in the wrong direction gives >= 0.063.
    tol = 0.04
    x = _blob((3.0, -2.0, 1.5), (7.0, 5.0, 6.0))
    y = op.transform_image(x)
    interior = (0, slice(10, 22), slice(10, 22), slice(10, 22))
    assert (op.invert(y) - x)[interior].abs().max() <= tol
    # the tolerance is tight enough to catch an inverse applied the wrong way round
    assert (op.transform_image(y) - x)[interior].abs().max() > tol


def test_affine_ops_flatten_leading_dims() -> None:
    op = get_tea_op("rotate_sagittal_acw_15")
    x = torch.rand(3, 2, 6, 7, 8, generator=torch.Generator().manual_seed(4))
    y = op.transform_image(x)
    assert y.shape == x.shape
    for i in range(3):
        torch.testing.assert_close(y[i], op.transform_image(x[i]))
    assert op.invert(y).shape == x.shape
    meta = op.transform_image(MetaTensor(x[0]))
    assert type(meta) is torch.Tensor


@pytest.mark.parametrize("op", [op for op in AFFINE_OPS if op.kind == "scale"], ids=lambda op: op.name)
def test_scale_down_shrinks_and_scale_up_enlarges(op: TEAOp) -> None:
    sphere = _sphere(7.0)
    zoom = (1.0 + op.magnitude) ** op.sign
    mass = op.transform_image(sphere).sum() / sphere.sum()
    assert mass == pytest.approx(zoom**3, rel=0.1)  # a solid sphere's volume scales with zoom^3
    count = op.transform_label(sphere.long()).sum()
    if op.magnitude >= 0.15:  # nearest neighbour may keep a sphere unchanged for a 5 % zoom
        assert (count < sphere.sum()) if op.sign < 0 else (count > sphere.sum())


@pytest.mark.parametrize("op", [op for op in AFFINE_OPS if op.kind == "rotate"], ids=lambda op: op.name)
def test_small_rotations_turn_like_rot90(op: TEAOp) -> None:
    a, b = rotation_plane(op.axis)
    offset = [0.0, 0.0, 0.0]
    offset[a] = 8.0
    blob = _blob(tuple(offset), (2.0, 2.0, 2.0))
    # where torch.rot90(k=1) sends the blob: +a -> +b, i.e. an anticlockwise quarter turn
    quarter = _centre_of_mass(torch.rot90(blob, 1, (a + 1, b + 1)))
    assert quarter[b] == pytest.approx(8.0, abs=0.1)
    moved = _centre_of_mass(op.transform_image(blob))
    angle = math.degrees(math.atan2(moved[b], moved[a]))
    assert angle == pytest.approx(op.sign * op.magnitude, abs=0.5)
    assert moved[op.axis].abs() < 0.1


# ---------------------------------------------------------------------------- intensity ops
@pytest.mark.parametrize("op", INTENSITY_OPS, ids=_ids(INTENSITY_OPS))
def test_intensity_ops_have_identity_inverse_and_keep_labels(op: TEAOp) -> None:
    x = torch.rand(2, 2, 6, 7, 8, generator=torch.Generator().manual_seed(5))
    assert torch.equal(op.invert(x), x)
    lab = torch.randint(0, 3, (1, 6, 7, 8), generator=torch.Generator().manual_seed(6))
    assert torch.equal(op.transform_label(lab), lab)
    y = op.transform_image(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    for i in range(2):  # each [C, X, Y, Z] sample is treated on its own
        torch.testing.assert_close(y[i], op.transform_image(x[i]))
    if op.kind != "identity":
        assert not torch.equal(y, x)


def _ramp() -> torch.Tensor:
    """[1, 3, 1, 1] spanning [0, 1] with a mid-grey voxel: values 0, 0.5, 1."""
    return torch.tensor([0.0, 0.5, 1.0]).view(1, 3, 1, 1)


@pytest.mark.parametrize(
    ("name", "curve"),
    [  # id: the op's name
        pytest.param(name, curve, id=name)
        for name, curve in (
            ("gamma_expand_0.3", lambda x: x**1.3),
            ("gamma_compress_0.3", lambda x: x ** (1 / 1.3)),
            ("gamma_expand_0.5", lambda x: x**1.5),
            ("inverted_gamma_expand_0.3", lambda x: 1 - (1 - x) ** 1.3),
            ("inverted_gamma_compress_0.1", lambda x: 1 - (1 - x) ** (1 / 1.1)),
        )
    ],
)
def test_gamma_values(name: str, curve) -> None:
    x = _ramp()
    out = get_tea_op(name).transform_image(x)
    torch.testing.assert_close(out, retaining_stats(curve(x), x), atol=1e-5, rtol=1e-5)
    expand = "expand" in name
    assert (out.flatten()[1].item() < 0.5) == (expand != name.startswith("inverted"))  # mid grey moved as the curve


def test_inverted_gamma_acts_on_the_inverted_image() -> None:
    x = torch.tensor([0.0, 0.25, 1.0]).view(1, 3, 1, 1)
    out = get_tea_op("inverted_gamma_expand_0.3").transform_image(x)
    torch.testing.assert_close(out, retaining_stats(1 - (1 - x) ** 1.3, x), atol=1e-5, rtol=1e-5)


def test_shift_scale_and_contrast_values() -> None:
    x = torch.tensor([0.0, 1.0, 2.0, 5.0]).view(1, 4, 1, 1)
    mean = x.mean()

    def run(name: str) -> torch.Tensor:
        return get_tea_op(name).transform_image(x)

    torch.testing.assert_close(run("shift_add_0.15"), x + 0.15)
    torch.testing.assert_close(run("shift_sub_0.25"), x - 0.25)
    torch.testing.assert_close(run("intensity_up_0.05"), x * 1.05)
    torch.testing.assert_close(run("intensity_down_0.25"), x / 1.25)
    torch.testing.assert_close(run("contrast_up_0.15"), (x - mean) * 1.15 + mean)
    torch.testing.assert_close(run("contrast_down_0.05"), (x - mean) / 1.05 + mean)


def test_noise_is_deterministic_with_the_right_std() -> None:
    x = torch.rand(1, 16, 16, 16, generator=torch.Generator().manual_seed(7))
    for name, std in (("noise_0.025", 0.025), ("noise_0.075", 0.075), ("noise_0.125", 0.125)):
        op = get_tea_op(name)
        y = op.transform_image(x)
        assert torch.equal(y, op.transform_image(x.clone()))
        assert (y - x).std().item() == pytest.approx(std, rel=0.1)
        assert (y - x).mean().abs().item() < 0.1 * std
    noises = [get_tea_op(i).transform_image(x) - x for i in (78, 79)]
    assert not torch.allclose(noises[0] / 0.025, noises[1] / 0.075)  # one seed per op


def test_blur_sharpen_and_low_resolution() -> None:
    x = torch.rand(1, 12, 12, 12, generator=torch.Generator().manual_seed(8))
    blurred = [get_tea_op(n).transform_image(x) for n in ("blur_0.5", "blur_0.7", "blur_0.9")]
    stds = [x.std().item()] + [b.std().item() for b in blurred]
    assert stds == sorted(stds, reverse=True)  # stronger blur, smoother image
    torch.testing.assert_close(get_tea_op("sharpen_0.7").transform_image(x), log_sharpen(x, 0.7))
    low = get_tea_op("low_resolution_0.5").transform_image(x)
    assert low.shape == x.shape
    # down to 6^3 and back up with nearest neighbour: 2x2x2 blocks of equal values
    assert torch.equal(low[:, ::2, ::2, ::2], low[:, 1::2, 1::2, 1::2])


def test_low_resolution_keeps_the_image_where_its_label_is() -> None:
    """Down and back up with the voxel centres aligned (scikit-image's ``resize``, the reference's): a blob's centroid
    stays where it was, on average over positions, at every zoom of the TRA and TEA catalogues. PyTorch's plain
    ``"nearest"`` moved it by +0.5 voxel per axis (at zooms 0.9 and 0.7; not at 0.5, a whole factor), so a drawn
    low resolution moved the image half a voxel against the label it trained on."""
    from jcsaug.ops.intensity import low_resolution

    grid = torch.stack(torch.meshgrid(*(torch.arange(n, dtype=torch.float64) for n in (40, 36, 32)), indexing="ij"))
    centres = 10 + 12 * torch.rand(48, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    blobs = torch.stack([torch.exp(-((grid - c[:, None, None, None]) ** 2).sum(0) / 18) for c in centres])

    def centroids(x: torch.Tensor) -> torch.Tensor:  # [B, 3]
        w = x.double() / x.double().sum(dim=(1, 2, 3), keepdim=True)
        return (w[:, None] * grid).sum(dim=(2, 3, 4))

    before = centroids(blobs)
    for zoom in (0.9, 0.85, 0.7, 0.65, 0.5, 0.45):
        moved = centroids(low_resolution(blobs[:, None].float(), [zoom] * len(centres))[:, 0]) - before
        assert moved.mean(0).abs().max().item() < 0.15, (zoom, moved.mean(0))  # +0.5 with the bug
        assert moved.abs().max().item() < 0.5, zoom
