"""What a dataset task is: its raw cases (:class:`RawCase`) and its fixed description (:class:`TaskSpec`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
    label turns out empty.
    """

    case_id: str
    image: Path
    label: Path | None
    domain: str = ""
    folder: str = ""
    frame: int | None = None
    subject: str = ""
    optional: bool = False

    @property
    def group(self) -> str:
        return self.subject or self.case_id


#: ``find_cases(raw_dir, skip_unlabelled) -> [RawCase]``
CaseFinder = Callable[[Path, bool], list[RawCase]]
#: ``assign_splits(cases, seed) -> {split: [case_id]}``
SplitRule = Callable[[list[RawCase], int], dict[str, list[str]]]


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
        find_cases: lists the raw cases (see :data:`CaseFinder`); ``layout`` describes what it expects.
        assign_splits: the paper's split rule (see :data:`SplitRule`).
        report_classes: named class subsets the paper reports (``{"tumour": (2,)}``).
        foreground_splits: splits whose cases must contain foreground (patch sampling and validation need it).
        copy_image_geometry_to_label: a label whose affine disagrees with its image's (same shape) gets the
            image's (a known quirk of the prostate data) instead of an error.
        source: where the data is published.
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
    foreground_splits: tuple[str, ...] = ("training", "validation")
    copy_image_geometry_to_label: bool = False
    source: str = ""

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def class_of(self, raw_value: int) -> int | None:
        """Class of a raw label value, or ``None`` if the task has no such value."""
        if self.label_map is not None:
            return self.label_map.get(int(raw_value))
        return int(raw_value) if int(raw_value) in self.labels else None
