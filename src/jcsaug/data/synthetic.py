"""A tiny, deterministic 3D lesion-segmentation task with a domain shift (the default bundle's data).

Every case is a float32 volume (roughly z-scored) with a uint8 label (0 background, 1 lesion):

* **background**: three "tissue" classes from a thresholded smooth noise field (soft boundaries, fine
  texture), a smooth multiplicative bias field with a ramp along array axis 0, and Gaussian noise;
* **distractors**: 2-5 round blobs about as bright as the lesions, so thresholding alone fails;
* **lesions**: 2-6 elongated ellipsoids (long/short radius 2-3, random tilt up to 25 degrees), some with
  an irregular boundary (the ellipsoid distance thresholded against smooth noise), textured and brighter
  than their surroundings by 0.28-0.42 tissue units. The lesion sizes are drawn so that the foreground
  is 1-3 % of the voxels (a case is redrawn until it is).

Training cases come from the **source** domain, validation and test cases from the **target** domain.
The shift is built from ops of the TRA catalogue (:mod:`jcsaug.ops.tra`), so that learned augmentation
can undo it:

==================  =========================================  =========================================
aspect              source (training)                          target (validation, test)
==================  =========================================  =========================================
lesion long axis    array axis 0 (sagittal)                    array axis 2 (longitudinal): a 90-degree
                                                               rotation about the frontal axis
placement, bias     lesion centres in the low 60 % of axis 0,  mirrored in the sagittal plane (array
                    bias field increasing along axis 0         axis 0 flipped): centres in the high 60 %
intensity           z-scored                                   robustly rescaled to [0, 1], raised to a
                                                               gamma in [1.4, 1.6), then z-scored
==================  =========================================  =========================================

:data:`TARGET_SHIFTS` names other target domains built the same way: ``rotate-longitudinal`` (lesions along array
axis 1, no mirror, a gamma below 1), ``blur`` (no geometric change, no gamma: the z-scored image smoothed by a
Gaussian of sigma 0.8-1 voxel, as a softer scanner would give) and ``gamma`` (the default shift's intensity
change alone: no geometric change, the rescaled image raised to a gamma in [1.4, 1.6)). A shift nobody named is given
as a mapping of the same keys (:data:`SHIFT_KEYS`; :func:`resolve_target_shift`), e.g. ``{"long_axis": 1,
"mirror_axis0": True, "blur": (0.8, 1.0)}``: lesions along array axis 1, mirrored, blurred. Two aspects only a mapping
uses: ``scale`` (the scene magnified about the volume's centre by a factor drawn in the range, image and label, as a
scanner with a finer voxel spacing would show it; below 1 it shrinks, the border filled by reflection; the foreground
fraction changes with it) and ``noise`` (Gaussian noise of a standard deviation drawn in the range added to the
z-scored, possibly blurred, image: a noisier scanner) and ``low_resolution`` (the image zoomed down by a factor
drawn in the range, trilinear, and back up, nearest, as the TRA's low-resolution op does to a patch: a scanner with
thicker voxels; applied last).

Layout written under ``out_dir`` (file names are unique across splits, numbered training first)::

    imagesTr/case_000.nii.gz ...   labelsTr/case_000.nii.gz ...   training   (source domain)
    imagesVa/case_016.nii.gz ...   labelsVa/case_016.nii.gz ...   validation (target domain)
    imagesTs/case_020.nii.gz ...   labelsTs/case_020.nii.gz ...   test       (target domain)
    dataset.json                   MONAI datalist: "training", "validation", "test" + metadata
    .jcsaug-synthetic              written first: the folder is jcsaug's (only such or empty folders are written)

Images and labels carry a 1 mm diagonal RAS affine. Case ``i`` of a split is drawn from its own seed
(``SeedSequence(seed, spawn_key=(split, i))``), so it does not change when other counts change.
"""

from __future__ import annotations

import gzip
import json
import math
import numbers
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage
from tqdm.auto import tqdm

from jcsaug.utils import atomic_write_bytes, atomic_write_text

__all__ = [
    "CUSTOM_SHIFT",
    "SPLITS",
    "SHIFT_KEYS",
    "TARGET_SHIFTS",
    "changed_aspects",
    "describe_shift",
    "make_synthetic_dataset",
    "parse_target_shift",
    "resolve_target_shift",
    "shift_undoing_ops",
    "synthesize_case",
    "synthetic_datalist",
]

#: split name -> (image folder, label folder, domain)
SPLITS: dict[str, tuple[str, str, str]] = {
    "training": ("imagesTr", "labelsTr", "source"),
    "validation": ("imagesVa", "labelsVa", "target"),
    "test": ("imagesTs", "labelsTs", "target"),
}

_DOMAINS = {
    # long axis of the lesions, mirror along array axis 0, gamma range (None = no gamma), Gaussian blur sigma range
    # of the z-scored image (None = no blur), magnification range (None = none), sd range of the added noise
    # (None = none), zoom range of the low resolution (None = none); a mapping's missing key reads as the source's
    # (resolve_target_shift)
    "source": {
        "long_axis": 0,
        "mirror_axis0": False,
        "gamma": None,
        "blur": None,
        "scale": None,
        "noise": None,
        "low_resolution": None,
    },
    "target": {
        "long_axis": 2,
        "mirror_axis0": True,
        "gamma": (1.4, 1.6),
        "blur": None,
        "scale": None,
        "noise": None,
        "low_resolution": None,
    },
}

#: Named target domains (``make_synthetic_dataset(target_shift=...)``): the default one, and others that check
#: that learned augmentation finds *whatever* undoes the shift (another rotation plane, another intensity change).
TARGET_SHIFTS: dict[str, dict] = {
    "default": _DOMAINS["target"],
    # lesions along array axis 1 (a quarter turn about the longitudinal axis), no mirror, the image raised to a
    # power below 1 (the gamma of the other sign)
    "rotate-longitudinal": {**_DOMAINS["source"], "long_axis": 1, "gamma": (0.62, 0.71)},
    # no geometric change and no gamma: the z-scored image blurred (sigma 0.8-1 voxel), an intensity change of
    # another kind (undone by the TRA's strongest blur, roughly by the TEA's sharpening)
    "blur": {**_DOMAINS["source"], "blur": (0.8, 1.0)},
    # the default shift's intensity change alone (no geometric change): costs the heuristic Dice; the TRA's gamma
    # bin of the power reproduces its curve on a patch (the + half of split-signs; SPEC's draws the sign), the TEA's
    # gamma compression undoes it
    "gamma": {**_DOMAINS["source"], "gamma": (1.4, 1.6)},
}
#: the keys of a target domain; a ``target_shift`` mapping's missing keys take the source domain's values
SHIFT_KEYS = ("long_axis", "mirror_axis0", "gamma", "blur", "scale", "noise", "low_resolution")
CUSTOM_SHIFT = "custom"
"""The name recorded for a ``target_shift`` mapping that equals no :data:`TARGET_SHIFTS` entry."""

_FG_RANGE = (0.011, 0.029)  # accepted foreground fraction (inside the promised 1-3 %)
_TISSUE_LEVELS = (0.35, 0.5, 0.7)
_NOISE_STD = 0.035
_MAX_TILT_DEG = 25.0


#: the range aspects of a target domain -> whether their lower bound must be above 0 (a factor) or may be 0
_RANGE_KEYS = {"gamma": True, "blur": False, "scale": True, "noise": False, "low_resolution": True}
#: the range aspects whose upper bound is capped (a low resolution zooms down: a factor of at most 1)
_RANGE_MAX = {"low_resolution": 1.0}
_AXIS_NAMES = ("sagittal", "frontal", "longitudinal")  # array axes 0, 1, 2 after RAS (jcsaug.ops.axes)


def describe_shift(target: str | Mapping) -> str:
    """A target domain's shift (any ``target_shift``, :func:`resolve_target_shift`) in words (``"no shift"`` for the
    source domain's own)."""
    target = resolve_target_shift(target)[1]
    parts = []
    if target["long_axis"] != 0:
        parts.append(f"lesion long axis rotated from array axis 0 to {target['long_axis']}")
    if target["mirror_axis0"]:
        parts.append("placement and bias field mirrored along axis 0")
    if target["gamma"] is not None:
        parts.append(f"gamma {target['gamma'][0]:g}-{target['gamma'][1]:g} on the [0, 1]-rescaled image")
    if target["blur"] is not None:
        parts.append(f"Gaussian blur sigma {target['blur'][0]:g}-{target['blur'][1]:g} voxel")
    if target["scale"] is not None:
        parts.append(f"scene magnified by {target['scale'][0]:g}-{target['scale'][1]:g}")
    if target["noise"] is not None:
        parts.append(f"Gaussian noise sd {target['noise'][0]:g}-{target['noise'][1]:g}")
    if target["low_resolution"] is not None:
        lo, hi = target["low_resolution"]
        parts.append(f"resolution reduced by a zoom of {lo:g}-{hi:g} (down and up again)")
    return ", ".join(parts) or "no shift"


def _check_pair(key: str, value: object, open_low: bool, high: float = math.inf) -> tuple[float, float] | None:
    """A ``gamma`` / ``blur`` / ``scale`` / ``noise`` / ``low_resolution`` range: ``None`` or finite ``lo < hi`` with
    ``0 < lo`` (``open_low``) or ``0 <= lo``, and ``hi <= high``."""
    if value is None:
        return None
    pair = tuple(value) if isinstance(value, (list, tuple)) else ()
    if len(pair) == 2 and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in pair):
        lo, hi = float(pair[0]), float(pair[1])
        if math.isfinite(hi) and (lo > 0 if open_low else lo >= 0) and lo < hi <= high:
            return lo, hi
    bound = ("0 < lo < hi" if open_low else "0 <= lo < hi") + (f" <= {high:g}" if math.isfinite(high) else "")
    raise ValueError(f"target_shift {key!r} must be null or a pair [lo, hi] of finite numbers, {bound}; got {value!r}")


def resolve_target_shift(shift: str | Mapping) -> tuple[str, dict]:
    """``(name, target domain)`` of a ``target_shift``: a :data:`TARGET_SHIFTS` name, or a mapping of
    :data:`SHIFT_KEYS` (a missing key: the source domain's value, no change in that aspect; ``long_axis`` 0,
    ``mirror_axis0`` False, ``gamma``, ``blur``, ``scale``, ``noise`` and ``low_resolution`` None; ranges as lists or
    tuples: ``gamma`` and ``scale`` ``0 < lo < hi``, ``blur`` and ``noise`` ``0 <= lo < hi``, ``low_resolution``
    ``0 < lo < hi <= 1``), checked and normalised (ranges as float tuples). A mapping equal to a named shift gets its
    name, any other :data:`CUSTOM_SHIFT` (the source domain itself, ``{}``, is allowed: a control with no shift).

    Raises:
        ValueError: an unknown name or key, or a value out of range (named in the message).
    """
    if isinstance(shift, str):
        if shift not in TARGET_SHIFTS:
            raise ValueError(f"unknown target_shift {shift!r}; choose one of {sorted(TARGET_SHIFTS)} or give a mapping")
        shift = TARGET_SHIFTS[shift]
    elif not isinstance(shift, Mapping):
        raise ValueError(f"target_shift must be a name of TARGET_SHIFTS or a mapping, got {shift!r}")
    unknown = [key for key in shift if key not in SHIFT_KEYS]
    if unknown:
        raise ValueError(f"unknown target_shift key(s) {unknown}; the keys are {list(SHIFT_KEYS)}")
    cfg = {**_DOMAINS["source"], **shift}
    axis, mirror = cfg["long_axis"], cfg["mirror_axis0"]
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or not 0 <= axis <= 2:
        raise ValueError(f"target_shift 'long_axis' must be the integer 0, 1 or 2, got {axis!r}")
    if not isinstance(mirror, bool):
        raise ValueError(f"target_shift 'mirror_axis0' must be true or false, got {mirror!r}")
    target = {"long_axis": int(axis), "mirror_axis0": mirror,
              **{key: _check_pair(key, cfg[key], open_low, _RANGE_MAX.get(key, math.inf))
                 for key, open_low in _RANGE_KEYS.items()}}  # fmt: skip
    return next((name for name, known in TARGET_SHIFTS.items() if known == target), CUSTOM_SHIFT), target


def parse_target_shift(text: str) -> str | dict:
    """A ``target_shift`` written as text (a command line's ``--shift``): a :data:`TARGET_SHIFTS` name, or a JSON object
    of :data:`SHIFT_KEYS`, e.g. ``'{"long_axis": 1, "blur": [0.8, 1.0]}'``; checked (:func:`resolve_target_shift`) and
    returned as given (the name, or the parsed mapping).

    Raises:
        ValueError: text that starts with ``{`` but is not a JSON object, or a shift :func:`resolve_target_shift`
            refuses (the message names the bad name, key or value).
    """
    shift: str | dict = text
    if text.lstrip().startswith("{"):
        try:
            shift = json.loads(text)
        except ValueError as err:
            raise ValueError(f"target_shift is not a JSON object ({err}): {text}") from None
    resolve_target_shift(shift)
    return shift


def changed_aspects(shift: str | Mapping) -> dict:
    """The aspects of a ``target_shift`` (:func:`resolve_target_shift`) that differ from the source domain, ranges as
    lists (JSON's form): ``{"long_axis": 1, "blur": [0.8, 1.0]}``; ``{}`` for no shift."""
    target = resolve_target_shift(shift)[1]
    return {key: list(value) if isinstance(value, tuple) else value
            for key, value in target.items() if value != _DOMAINS["source"][key]}  # fmt: skip


def _recorded_target(found: Mapping) -> dict | None:
    """The target domain a ``dataset.json`` records (``target_shift``: absent for the default one, else a name or a
    mapping); ``None`` when it names none."""
    try:
        return resolve_target_shift(found.get("target_shift", "default"))[1]
    except ValueError:
        return None


def _tra_op(series: str, kind: str, magnitude: float) -> str:
    """The name of the op of TRA series ``series`` and ``kind`` whose magnitude bin holds ``magnitude`` (the nearest
    bin when none does), looked up in the catalogue (:data:`jcsaug.ops.tra.TRA_SERIES`)."""
    from jcsaug.ops.tra import TRA_SERIES

    ops = [op for op in next(s for s in TRA_SERIES if s.name == series).ops if op.kind == kind]
    return min(ops, key=lambda op: max(op.low - magnitude, magnitude - op.high, 0.0)).name


def _tea_op(kind: str, magnitude: float, sign: int = 1) -> str:
    """The name of the TEA op of ``kind`` and ``sign`` whose magnitude is nearest ``magnitude``
    (:data:`jcsaug.ops.tea.TEA_OPS`)."""
    from jcsaug.ops.tea import TEA_OPS

    ops = [op for op in TEA_OPS if op.kind == kind and op.sign == sign]
    return min(ops, key=lambda op: abs(op.magnitude - magnitude)).name


def _factor_magnitude(factor: float) -> float:
    """The magnitude ``M`` of a gamma exponent or a zoom factor, as the catalogues' ``(1 + M) ** ±1``."""
    return factor - 1.0 if factor >= 1.0 else 1.0 / factor - 1.0


def shift_undoing_ops(target: str | Mapping, source: Mapping = _DOMAINS["source"]) -> dict:
    """The TRA and TEA ops of the catalogues (SPEC §2-3) that undo a target domain's shift, by name.

    TRA ops make a source patch look like the target (``{"series", "op"}``, one per aspect of the shift; the gamma
    op is marked ``"partial"``: its sign is drawn, so half of its draws reproduce the shift and half go the other
    way; so is the zoom's; a partial entry's ``"sign"`` names the half that reproduces the shift in the
    ``split-signs`` catalogue, :func:`jcsaug.ops.catalogue.split_signs`, where that half is exact); TEA ops map a
    target image back to the source (per aspect, the list of TEA op names that each undo it, e.g. both quarter
    turns; none for added noise, which no TEA op removes). The ops are looked up in the catalogues: the TRA bin that
    holds the shift's magnitude (the nearest outside them), the TEA op of the nearest magnitude. Read by the
    learning-quality benchmark from ``dataset.json`` (its oracle sets the TRA ops by hand; it reports the learned
    probabilities of both), never by the learning itself. ``target`` is any ``target_shift``
    (:func:`resolve_target_shift`); each aspect of a combined shift is undone by its own ops: a lesion long axis
    turned from ``a`` to ``b`` by a quarter turn about the third axis, the placement mirrored along array axis 0 by
    the sagittal mirror, a gamma, a blur, a zoom, added noise, a low resolution (the TRA's op of that zoom; no TEA op
    restores resolution).
    """
    target = resolve_target_shift(target)[1]
    tra: list[dict] = []
    tea: list[list[str]] = []
    if target["long_axis"] != source["long_axis"]:  # a quarter turn about the third axis
        axis = _AXIS_NAMES[3 - target["long_axis"] - source["long_axis"]]
        tra.append({"series": f"rotate_{axis}", "op": "rot90"})
        tea.append([f"rotate_{axis}_acw_90", f"rotate_{axis}_cw_90"])
    if bool(target["mirror_axis0"]) != bool(source["mirror_axis0"]):
        tra.append({"series": "mirror_sagittal", "op": "flip"})
        tea.append(["mirror_sagittal"])
    if target["gamma"] is not None:
        power = sum(target["gamma"]) / 2.0  # target = rescaled source ** power
        magnitude = _factor_magnitude(power)
        # the TRA's gamma raises to (1 + M) ** sign: the + half darkens as a power above 1 does
        sign = "+" if power >= 1.0 else "-"
        tra.append({"series": "gamma", "op": _tra_op("gamma", "gamma", magnitude), "partial": True, "sign": sign})
        tea.append([_tea_op("gamma", magnitude, sign=-1 if power >= 1.0 else 1)])  # the exponent 1 / power
    if target["blur"] is not None:
        sigma = sum(target["blur"]) / 2.0
        tra.append({"series": "blur_sharpen", "op": _tra_op("blur_sharpen", "blur", sigma)})
        tea.append([_tea_op("sharpen", sigma)])  # x - LoG(x, sigma): undoes a blur of about that sigma, roughly
    if target["scale"] is not None:  # the TRA's zoom draws its direction: "partial", as the gamma
        factor = sum(target["scale"]) / 2.0
        magnitude = _factor_magnitude(factor)
        # the TRA's zoom scales the sampling grid by (1 + M) ** sign: the - half (a grid below 1) magnifies
        sign = "-" if factor >= 1.0 else "+"
        tra.append({"series": "scale", "op": _tra_op("scale", "scale", magnitude), "partial": True, "sign": sign})
        tea.append([_tea_op("scale", magnitude, sign=-1 if factor >= 1.0 else 1)])  # shrink what grew, and back
    if target["noise"] is not None:  # no TEA op removes noise: the TEA has no aspect for it
        tra.append({"series": "noise", "op": _tra_op("noise", "noise", sum(target["noise"]) / 2.0)})
    if target["low_resolution"] is not None:  # nor restores resolution
        zoom = sum(target["low_resolution"]) / 2.0
        tra.append({"series": "low_resolution", "op": _tra_op("low_resolution", "low_resolution", zoom)})
    return {"tra": tra, "tea": tea}


# ----------------------------------------------------------------------------------------------- helpers
def _smooth_noise(rng: np.random.Generator, shape: Sequence[int], sigma: float) -> np.ndarray:
    """Gaussian-smoothed white noise rescaled to zero mean and unit standard deviation."""
    f = ndimage.gaussian_filter(rng.standard_normal(shape), sigma, mode="wrap")
    return (f - f.mean()) / (f.std() + 1e-12)


def _random_rotation(rng: np.random.Generator, max_deg: float) -> np.ndarray:
    """A rotation matrix about a random axis by an angle up to ``max_deg`` degrees (Rodrigues)."""
    axis = rng.standard_normal(3)
    axis /= np.linalg.norm(axis) + 1e-12
    angle = math.radians(rng.uniform(-max_deg, max_deg))
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.eye(3) + math.sin(angle) * k + (1 - math.cos(angle)) * (k @ k)


def _ellipsoid_mask(
    shape: Sequence[int],
    centre: np.ndarray,
    radii: np.ndarray,
    rot: np.ndarray,
    boundary_noise: np.ndarray | None = None,
    irregularity: float = 0.0,
) -> tuple[tuple[slice, ...], np.ndarray]:
    """Mask of a rotated ellipsoid inside its bounding box; returns ``(box slices, mask)``."""
    reach = float(radii.max()) * (1.0 + irregularity) + 1.0
    lo = np.maximum(np.floor(centre - reach).astype(int), 0)
    hi = np.minimum(np.ceil(centre + reach).astype(int) + 1, np.asarray(shape))
    box = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))
    grids = np.meshgrid(*[np.arange(a, b, dtype=np.float64) - c for a, b, c in zip(lo, hi, centre)], indexing="ij")
    local = np.einsum("ji,j...->i...", rot, np.stack(grids))  # coordinates in the ellipsoid's frame (R^T x)
    dist = np.sqrt(sum((local[i] / radii[i]) ** 2 for i in range(3)))
    threshold = 1.0 if boundary_noise is None else 1.0 + irregularity * boundary_noise[box]
    mask = dist < threshold
    if irregularity > 0:  # the noisy threshold may leave islands: keep the largest piece
        pieces, n = ndimage.label(mask)
        if n > 1:
            mask = pieces == 1 + int(np.argmax(np.bincount(pieces.ravel())[1:]))
    return box, mask


def _place(
    rng: np.random.Generator,
    occupied: np.ndarray,
    radii: np.ndarray,
    rot: np.ndarray,
    axis0_span: tuple[float, float],
    boundary_noise: np.ndarray | None,
    irregularity: float,
    tries: int = 60,
) -> tuple[tuple[slice, ...], np.ndarray] | None:
    """Place a shape without touching ``occupied`` (one voxel gap); ``None`` if no place was found."""
    shape = np.asarray(occupied.shape)
    margin = np.minimum(np.ceil(radii.max()) + 1, shape / 2 - 1)
    lo, hi = margin, shape - 1 - margin
    for _ in range(tries):
        centre = rng.uniform(lo, hi)
        centre[0] = lo[0] + (hi[0] - lo[0]) * rng.uniform(*axis0_span)
        box, mask = _ellipsoid_mask(occupied.shape, centre, radii, rot, boundary_noise, irregularity)
        if mask.sum() == 0:
            continue
        if not (ndimage.binary_dilation(mask, iterations=1) & occupied[box]).any():
            return box, mask
    return None


def _magnify(image: np.ndarray, label: np.ndarray, factor: float) -> tuple[np.ndarray, np.ndarray]:
    """The scene magnified by ``factor`` about the volume's centre (linear for the image, nearest for the label; the
    border a shrunk scene leaves filled by reflection, the same for both)."""
    centre = (np.asarray(image.shape) - 1) / 2.0
    matrix, offset = np.eye(3) / factor, centre * (1.0 - 1.0 / factor)  # output voxel o reads input M @ o + offset
    image = ndimage.affine_transform(image, matrix, offset, order=1, mode="reflect")
    label = ndimage.affine_transform(label.astype(np.uint8), matrix, offset, order=0, mode="reflect")
    return image, label.astype(bool)


def _low_resolution(image: np.ndarray, zoom: float) -> np.ndarray:
    """The image zoomed down by ``zoom`` and back up: the TRA's own op (:func:`jcsaug.ops.intensity.low_resolution`),
    so that its bin reproduces the shift exactly."""
    import torch

    from jcsaug.ops.intensity import low_resolution

    x = torch.from_numpy(np.ascontiguousarray(image, dtype=np.float32))[None, None]
    return low_resolution(x, [zoom])[0, 0].numpy()


# ----------------------------------------------------------------------------------------------- one case
def _lesion_label(rng: np.random.Generator, shape: tuple[int, int, int], long_axis: int) -> np.ndarray | None:
    """2-6 non-touching elongated lesions covering a drawn 1.4-2.6 % of the volume (``None``: redraw)."""
    n_vox = float(np.prod(shape))
    n_lesions = int(rng.integers(2, 7))
    shares = 0.5 / n_lesions + 0.5 * rng.dirichlet(np.full(n_lesions, 2.0))  # each >= half an equal share
    volumes = rng.uniform(0.014, 0.026) * n_vox * shares
    boundary_noise = _smooth_noise(rng, shape, 1.5)
    label = np.zeros(shape, dtype=bool)
    for volume in sorted(volumes, reverse=True):
        elong = rng.uniform(2.0, 3.0)
        short = rng.uniform(0.85, 1.15, size=2)
        b = (volume / (4.0 / 3.0 * math.pi * elong * short[0] * short[1])) ** (1.0 / 3.0)
        radii = np.empty(3)
        radii[long_axis] = elong * b
        radii[[i for i in range(3) if i != long_axis]] = short * b
        irregularity = rng.choice([0.0, rng.uniform(0.1, 0.3)])
        placed = _place(
            rng, label, radii, _random_rotation(rng, _MAX_TILT_DEG), (0.0, 0.6), boundary_noise, irregularity
        )
        if placed is None:
            return None
        box, mask = placed
        label[box] |= mask
    return label


def synthesize_case(
    rng: np.random.Generator, shape: tuple[int, int, int] = (48, 48, 48), domain: str | Mapping = "source"
) -> tuple[np.ndarray, np.ndarray]:
    """Draw one case of ``domain`` (``"source"``, ``"target"`` or a target domain's mapping, a :data:`TARGET_SHIFTS`
    entry or any :func:`resolve_target_shift` accepts): ``(float32 image, uint8 label)``."""
    if isinstance(domain, Mapping):
        cfg = resolve_target_shift(domain)[1]
    elif domain in _DOMAINS:
        cfg = _DOMAINS[domain]
    else:
        raise ValueError(f"domain must be one of {sorted(_DOMAINS)}, got {domain!r}")
    shape = tuple(int(s) for s in shape)
    for _ in range(25):
        label = _lesion_label(rng, shape, cfg["long_axis"])
        if label is not None and _FG_RANGE[0] <= label.mean() <= _FG_RANGE[1]:
            break
    else:  # pragma: no cover - the sizes are drawn inside the range; only degenerate shapes get here
        raise RuntimeError(f"could not draw lesions with a 1-3 % foreground in shape {shape}")

    # Tissue: three classes from thresholded smooth noise, soft boundaries, fine texture.
    field = _smooth_noise(rng, shape, max(shape) / 10.0)
    tissue = np.choose(np.digitize(field, [-0.5, 0.6]), _TISSUE_LEVELS)
    image = ndimage.gaussian_filter(tissue, 1.0) + 0.03 * _smooth_noise(rng, shape, 1.0)

    # Distractors: round blobs as bright as (slightly dimmer than) the lesions, away from them.
    lesion_scale = (label.sum() / 4.0 / (4.0 / 3.0 * math.pi)) ** (1.0 / 3.0)
    blobs = np.zeros(shape)
    occupied = label.copy()
    for _ in range(int(rng.integers(2, 6))):
        radii = np.full(3, lesion_scale * rng.uniform(0.9, 1.4))
        placed = _place(rng, occupied, radii, np.eye(3), (0.0, 1.0), None, 0.0, tries=20)
        if placed is not None:
            box, mask = placed
            occupied[box] |= mask
            blobs[box] += mask * rng.uniform(0.12, 0.28)
    # Lesions: textured, 0.28-0.42 brighter than the tissue they sit in; partial-volume edges.
    components, n = ndimage.label(label)
    contrast = np.concatenate([[0.0], rng.uniform(0.28, 0.42, size=n)])[components]
    contrast *= 1.0 + 0.15 * _smooth_noise(rng, shape, 1.0)
    image += ndimage.gaussian_filter(blobs + contrast, 0.6)

    # Bias field: a ramp along array axis 0 and a smooth random part; then noise.
    ramp = np.linspace(-1.0, 1.0, shape[0])[:, None, None]
    image *= 1.0 + 0.12 * ramp + 0.06 * _smooth_noise(rng, shape, max(shape) / 4.0)
    image += rng.normal(0.0, _NOISE_STD, size=shape)

    if cfg["mirror_axis0"]:
        image, label = image[::-1], label[::-1]
    if cfg["scale"] is not None:
        image, label = _magnify(image, label, rng.uniform(*cfg["scale"]))
    if cfg["gamma"] is not None:
        lo, hi = np.percentile(image, [0.5, 99.5])
        image = np.clip((image - lo) / (hi - lo), 0.0, 1.0) ** rng.uniform(*cfg["gamma"])
    image = (image - image.mean()) / (image.std() + 1e-8)
    if cfg["blur"] is not None:  # after z-scoring: exactly what the TRA's blur does to a source patch
        image = ndimage.gaussian_filter(image, rng.uniform(*cfg["blur"]))
    if cfg["noise"] is not None:  # on the z-scored image, as the TRA's noise on a source patch
        image = image + rng.normal(0.0, rng.uniform(*cfg["noise"]), size=shape)
    if cfg["low_resolution"] is not None:  # last, as the TRA's low resolution (the last series) on a source patch
        image = _low_resolution(image, rng.uniform(*cfg["low_resolution"]))
    return np.ascontiguousarray(image, dtype=np.float32), np.ascontiguousarray(label, dtype=np.uint8)


# ----------------------------------------------------------------------------------------------- files
def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_shape(shape: object) -> tuple[int, int, int]:
    try:
        dims = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"shape must be a sequence of 3 integers >= 16, got {shape!r}") from None
    if len(dims) != 3 or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 16 for d in dims):
        raise ValueError(f"shape must be a sequence of 3 integers >= 16, got {shape!r}")
    return tuple(int(d) for d in dims)  # type: ignore[return-value]


def _write_nifti(path: Path, array: np.ndarray) -> None:
    """Write a NIfTI with a 1 mm RAS affine; gzip without timestamp (same array -> same bytes), atomic."""
    img = nib.Nifti1Image(array, np.eye(4))
    img.header.set_xyzt_units("mm")
    img.set_qform(np.eye(4), code=1)
    img.set_sform(np.eye(4), code=1)
    atomic_write_bytes(path, gzip.compress(img.to_bytes(), compresslevel=6, mtime=0))


MARKER = ".jcsaug-synthetic"
"""File written first into a folder that :func:`make_synthetic_dataset` fills: the folder is jcsaug's own."""

_REFERENCE = "jcsaug.data.synthetic.make_synthetic_dataset"


def _read_datalist(json_path: Path) -> dict:
    """The existing ``dataset.json``, or a ``ValueError`` naming it when it cannot be read as a JSON object."""
    try:
        meta = json.loads(json_path.read_text())
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        reason = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    else:
        if isinstance(meta, dict):
            return meta
        reason = f"it holds a JSON {type(meta).__name__}, not an object"
    raise ValueError(
        f"cannot read the datalist {json_path} ({reason}); the synthetic dataset is not regenerated over the "
        f"files in {json_path.parent}: repair or delete that file (or pass overwrite=True if jcsaug made the folder)"
    )


def _made_by_jcsaug(out: Path, json_path: Path) -> bool:
    """Whether ``out`` is empty or was filled by :func:`make_synthetic_dataset` (its marker or its datalist)."""
    if not out.exists() or not any(out.iterdir()) or (out / MARKER).is_file():
        return True
    return json_path.is_file() and _read_datalist(json_path).get("reference") == _REFERENCE


def make_synthetic_dataset(
    out_dir: str | Path,
    num_train: int = 16,
    num_val: int = 4,
    num_test: int = 6,
    shape: tuple[int, int, int] = (48, 48, 48),
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    target_shift: str | Mapping | None = "default",
) -> Path:
    """Write the synthetic lesion dataset (layout and domain shift in the module docstring).

    Args:
        out_dir: folder to write into (created if missing).
        num_train, num_val, num_test: number of cases per split (positive).
        shape: spatial shape of every volume, three sizes >= 16.
        seed: non-negative integer; the same seed gives identical arrays.
        overwrite: regenerate even if ``out_dir/dataset.json`` exists (stale ``case_*.nii.gz`` of the
            six split folders are removed first). Only in a folder jcsaug made.
        progress: show a tqdm progress bar.
        target_shift: the validation/test domain, a name of :data:`TARGET_SHIFTS` (``"default"`` is the one
            in the module docstring) or a mapping of :data:`SHIFT_KEYS` (:func:`resolve_target_shift`).
            ``dataset.json`` records it as ``target_shift`` (the name; the normalised mapping when it equals no named
            shift, then ``domain_shift.name`` is ``"custom"``; absent for the default one); its ``domain_shift``
            describes it and names the TRA and TEA ops that undo it (:func:`shift_undoing_ops`). An existing dataset
            is compared by the shift's mapping (a name and an equal mapping are the same shift). ``None``: an
            existing dataset whatever its shift (e.g. a benchmark's), else the default one.

    Returns:
        The path of ``dataset.json``. If it already exists and ``overwrite`` is False it is returned
        as is (a warning is issued if it was made with other arguments). It is written last and
        atomically, so an interrupted generation never looks finished.

    Raises:
        ValueError: ``dataset.json`` exists but cannot be read (it is never regenerated over), or ``out_dir``
            holds other files and was not made by this function (its :data:`MARKER` file, written first, or
            its ``dataset.json``): files of a user are never overwritten.
    """
    counts = {
        "training": _check_count("num_train", num_train),
        "validation": _check_count("num_val", num_val),
        "test": _check_count("num_test", num_test),
    }
    dims = _check_shape(shape)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out_dir {str(out)!r} exists and is not a directory")
    json_path = out / "dataset.json"
    any_shift = target_shift is None
    shift_name, target = resolve_target_shift("default" if target_shift is None else target_shift)
    recorded = shift_name if shift_name != CUSTOM_SHIFT else json.loads(json.dumps(target))  # ranges as lists
    expected = {"seed": int(seed), "shape": list(dims), **{f"num_{k}": v for k, v in counts.items()}}
    if shift_name != "default":  # (default datasets keep the keys they always had: old folders stay valid)
        expected["target_shift"] = recorded

    if json_path.is_file() and not overwrite:
        found = _read_datalist(json_path)
        # a folder without the key holds the default shift; asked for the default, another one is a mismatch too
        matches = all(found.get(k) == v for k, v in expected.items() if k != "target_shift") and (
            any_shift or _recorded_target(found) == target
        )
        if not matches:
            warnings.warn(
                f"{json_path} exists but was not made with "
                f"{expected if any_shift else {**expected, 'target_shift': recorded}}; returning it unchanged "
                "(pass overwrite=True to regenerate)",
                stacklevel=2,
            )
        return json_path
    if not _made_by_jcsaug(out, json_path):
        raise ValueError(
            f"{out} is not empty and was not made by make_synthetic_dataset (no {MARKER} file, no jcsaug "
            "dataset.json): the synthetic dataset is only written into an empty folder or one jcsaug made; "
            "choose another folder"
        )

    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(json.dumps({"reference": _REFERENCE, **expected}) + "\n")
    json_path.unlink(missing_ok=True)
    for img_dir, lbl_dir, _ in SPLITS.values():
        for sub in (img_dir, lbl_dir):
            (out / sub).mkdir(exist_ok=True)
            if overwrite:
                for stale in (out / sub).glob("case_*.nii.gz"):
                    stale.unlink()

    datalist: dict[str, list[dict[str, str]]] = {}
    case_id = 0
    with tqdm(total=sum(counts.values()), desc="synthetic dataset", unit="case", disable=not progress) as bar:
        for split_idx, (split, (img_dir, lbl_dir, domain)) in enumerate(SPLITS.items()):
            entries = []
            for i in range(counts[split]):
                rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(split_idx, i)))
                image, label = synthesize_case(rng, dims, target if domain == "target" else domain)
                name = f"case_{case_id:03d}.nii.gz"
                _write_nifti(out / img_dir / name, image)
                _write_nifti(out / lbl_dir / name, label)
                entries.append({"image": f"{img_dir}/{name}", "label": f"{lbl_dir}/{name}"})
                case_id += 1
                bar.update(1)
            datalist[split] = entries

    meta = {
        "name": "jcsaug-synthetic-lesions",
        "description": (
            "Synthetic 3D lesion segmentation with a domain shift: training = source domain; validation "
            f"and test = target domain ({describe_shift(target)})."
        ),
        "reference": "jcsaug.data.synthetic.make_synthetic_dataset",
        "tensorImageSize": "3D",
        "modality": {"0": "synthetic"},
        "labels": {"0": "background", "1": "lesion"},
        **expected,
        "domain": {split: SPLITS[split][2] for split in SPLITS},
        "domain_shift": {
            "name": shift_name,
            "lesion_long_axis": {"source": 0, "target": target["long_axis"]},
            "mirror_axis": {"source": None, "target": 0 if target["mirror_axis0"] else None},
            **{
                key: {"source": None, "target": None if target[key] is None else list(target[key])}
                for key in _RANGE_KEYS
            },
            "undone_by": shift_undoing_ops(target),
        },
        **datalist,
    }
    atomic_write_text(json_path, json.dumps(meta, indent=2) + "\n")
    return json_path


def synthetic_datalist(out_dir: str | Path, **kwargs) -> Path:
    """:func:`make_synthetic_dataset` in a distributed run: rank 0 writes it, the other ranks then find it
    (``ignite.distributed.one_rank_first``); a plain call otherwise."""
    import ignite.distributed as idist

    with idist.one_rank_first():
        return make_synthetic_dataset(out_dir, **kwargs)
