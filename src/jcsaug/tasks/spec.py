"""What a dataset task is: its raw cases (:class:`RawCase`) and its fixed description (:class:`TaskSpec`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PrepareError", "RawCase", "TaskSpec"]


class PrepareError(ValueError):
    """Bad raw data or layout; the message names the case (or file) at fault."""


@dataclass(frozen=True)
class RawCase:
    """One labelled volume of a raw dataset, as found on disk.

    ``case_id`` names the prepared files (``images/<case_id>.nii.gz``); ``domain`` is the site, sequence or centre
    of cross-domain tasks; ``folder`` the dataset's own split folder where it has one (M&Ms ``Training`` ...);
    ``frame`` the time frame to take from a 4D volume (M&Ms ED/ES); ``subject`` groups volumes of one subject so
    they land in the same split; ``optional`` cases (M&Ms ``Unlabeled``) are left out, not refused, when their
    label turns out empty. ``extra_labels`` are further label files of the same volume, united with ``label``
    voxel by voxel (ATLAS R1.x: one file per lesion); with ``label_threshold`` the united label is binarised, 1
    where it is above the threshold (ATLAS R1.x's ``LesionSmooth`` masks, as the public loaders read them).
    """

    case_id: str
    image: Path
    label: Path | None
    domain: str = ""
    folder: str = ""
    frame: int | None = None
    subject: str = ""
    optional: bool = False
    extra_labels: tuple[Path, ...] = ()
    label_threshold: float | None = None

    @property
    def group(self) -> str:
        return self.subject or self.case_id


#: ``find_cases(raw_dir, skip_unlabelled) -> [RawCase]``
CaseFinder = Callable[[Path, bool], list[RawCase]]
#: ``assign_splits(cases, seed) -> {split: [case_id]}``
SplitRule = Callable[[list[RawCase], int], dict[str, list[str]]]
#: network -> training fraction -> ``(L_val, beta)`` (the paper's supplementary table)
SettingsTable = Mapping[str, Mapping[float, tuple[str, float]]]


@dataclass(frozen=True)
class TaskSpec:
    """A dataset task of the paper: labels, geometry, normalisation, raw layout and split rule.

    Args:
        name: bundle and CLI name (``kits19_tumor``).
        title: one line for tables.
        modality: ``"CT"`` (clip to foreground percentiles + dataset z-score) or ``"MR"`` (case-wise z-score).
        labels: class index -> name, contiguous from 0 (background).
        spacing: target voxel spacing in mm; a value ``<= 0`` keeps that axis' spacing (in-plane-only resampling).
        orientation: axis codes to reorient to (``"RAS"``), or ``None`` to keep the stored voxel axes (oblique
            cardiac short-axis stacks, whose slice axis must stay the last one).
        label_map: raw label value -> class; values outside it are errors. ``None``: values must be classes.
        binarise_labels: every positive raw value is class 1 (a two-class task whose masks carry other positive
            values, as the reference code binarises ``> 0``); negative values stay errors. Excludes ``label_map``.
        find_cases: lists the raw cases (see :data:`CaseFinder`); ``layout`` describes what it expects.
        assign_splits: the paper's split rule (see :data:`SplitRule`).
        report_classes: named foreground class subsets the paper reports (``{"tumour": (2,)}``), its headline
            first: ``metrics.json`` and the run summary give the mean Dice over each, and ``jcsaug report
            --task`` averages over the first (see :attr:`headline_classes`).
        foreground_splits: splits whose cases must contain foreground (patch sampling and validation need it).
        copy_image_geometry_to_label: a label whose affine disagrees with its image's in the voxel spacing only
            (same shape, axes and origin) gets the image's (a known quirk of the prostate data) instead of an
            error.
        source: where the data is published.
        paper_settings: what the paper trained with (SPEC §6): network -> training fraction -> ``(L_val, beta)``;
            read through :meth:`paper_setting`.
        patch_sizes: network -> the paper's training patch where it is not the network's default (64³ U-Net,
            37³ DeepMedic segment): e.g. 64 x 64 x 32 for prostate, 128 x 128 x 8 for cardiac MR.
        max_epochs: the paper's training budget (epochs of 100 iterations).
        train_on_val: the paper's final models of this task are trained on training + validation cases.
        nominal_spacing: the spacing networks are planned for (U-Net kernels and pooling) where ``spacing`` keeps
            an axis as acquired; see :attr:`planning_spacing`.
        single_component_classes: the foreground classes that are one connected structure anatomically, whose
            extra predicted components can only be false positives: what the bundles' ``--keep_largest_component
            task`` post-processes (:func:`jcsaug.evaluation.metrics.component_classes`). Not a class that is rightly
            several components: a label covering both kidneys, multifocal tumours or lesions.
        roi_threshold: the task's region of interest, in the prepared image's units (KiTS: -200 HU, the
            reference code's body mask): the largest connected component of the voxels above it, holes
            filled (:class:`jcsaug.data.ThresholdROId`). The bundles draw background patch centres inside it and set
            predictions outside it to background. ``None``: the whole volume.
    """

    name: str
    title: str
    modality: str
    labels: Mapping[int, str]
    spacing: tuple[float, float, float]
    orientation: str | None
    find_cases: CaseFinder
    layout: str
    assign_splits: SplitRule
    report_classes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    label_map: Mapping[int, int] | None = None
    binarise_labels: bool = False
    foreground_splits: tuple[str, ...] = ("training", "validation")
    copy_image_geometry_to_label: bool = False
    source: str = ""
    paper_settings: SettingsTable = field(default_factory=dict)
    patch_sizes: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)
    max_epochs: int = 1000
    train_on_val: bool = False
    nominal_spacing: tuple[float, float, float] | None = None
    single_component_classes: tuple[int, ...] = ()
    roi_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.binarise_labels and (self.label_map is not None or len(self.labels) != 2):
            raise ValueError(f"task {self.name!r}: binarise_labels is for two classes and without a label_map")
        if any(s <= 0 for s in self.spacing) and self.nominal_spacing is None:
            raise ValueError(f"task {self.name!r} keeps an axis' spacing: give nominal_spacing to plan networks with")
        for subset, classes in self.report_classes.items():
            if not classes or not set(classes) <= set(self.labels) - {0}:
                raise ValueError(f"task {self.name!r}: report_classes[{subset!r}] = {classes} are not foreground "
                                 f"classes of {dict(self.labels)}")  # fmt: skip
        single = self.single_component_classes
        if len(set(single)) != len(single) or not set(single) <= set(self.labels) - {0}:
            raise ValueError(f"task {self.name!r}: single_component_classes = {single} are not distinct foreground "
                             f"classes of {dict(self.labels)}")  # fmt: skip

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    @property
    def headline_classes(self) -> tuple[str, tuple[int, ...]] | None:
        """The paper's headline class subset ``(name, classes)``: the first of :attr:`report_classes` (``None``:
        the task has none, i.e. all foreground classes)."""
        return next(iter(self.report_classes.items()), None)

    @property
    def planning_spacing(self) -> tuple[float, float, float]:
        """Voxel spacing (mm) the networks are planned for: :attr:`spacing`, with an axis kept as acquired
        (``<= 0``) taken from :attr:`nominal_spacing` (e.g. a typical 10 mm between cardiac MR slices)."""
        nominal = self.nominal_spacing or self.spacing
        return tuple(float(n if s <= 0 else s) for s, n in zip(self.spacing, nominal))  # type: ignore[return-value]

    def paper_setting(self, network: str, train_fraction: float) -> tuple[str, float]:
        """``(L_val, beta)`` of ``network`` at ``train_fraction``; where the paper has no entry, the nearest fraction
        of that network or the table's first network, with a warning (see :func:`jcsaug.tasks.paper_setting`)."""
        from jcsaug.tasks.settings import paper_setting

        return paper_setting(self.paper_settings, network, train_fraction)

    def patch_size(self, network: str, default: Sequence[int] | None = None) -> tuple[int, ...] | None:
        """The paper's training patch of ``network`` on this task, else ``default`` (the network's own)."""
        patch = self.patch_sizes.get(network, default)
        return None if patch is None else tuple(int(p) for p in patch)

    def class_of(self, raw_value: int) -> int | None:
        """Class of a raw label value, or ``None`` if the task has no such value."""
        if self.binarise_labels:
            return None if int(raw_value) < 0 else int(int(raw_value) > 0)
        if self.label_map is not None:
            return self.label_map.get(int(raw_value))
        return int(raw_value) if int(raw_value) in self.labels else None
