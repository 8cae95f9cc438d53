"""Raw layouts of the six public datasets (``DATASETS.md``): find the labelled cases under a raw folder.

Each finder returns :class:`RawCase` entries and raises :class:`PrepareError` naming the case when a labelled
set misses a label (``skip_unlabelled=True`` leaves such cases out with a warning instead). Sets that are
unlabelled by design (ATLAS ``Testing``, KiTS cases >= 210, BTCV ``Testing``, MS-CMRSeg T2) are skipped silently.
"""

from __future__ import annotations

import csv
import logging
import re
from pathlib import Path

from jcsaug.tasks.spec import PrepareError, RawCase

__all__ = [
    "find_atlas",
    "find_atlas_r1",
    "find_btcv",
    "find_kits19",
    "find_mnms",
    "find_mscmrseg",
    "find_prostate",
    "read_mnms_table",
]

logger = logging.getLogger(__name__)

NII = ".nii.gz"


def _relative_parts(path: Path, root: Path) -> tuple[str, ...]:
    return path.relative_to(root).parts


def _label_or_missing(case_id: str, label: Path | None, skip_unlabelled: bool) -> Path | None:
    if label is not None and label.is_file():
        return label
    if skip_unlabelled:
        logger.warning("case %s: no label file (%s); left out (--skip-unlabelled)", case_id, label)
        return None
    raise PrepareError(
        f"case {case_id}: label file missing: {label} (pass --skip-unlabelled to leave unlabelled cases out)"
    )


def _no_cases(raw_dir: Path, expected: str) -> PrepareError:
    return PrepareError(f"no cases found under {raw_dir}: expected {expected}")


def find_atlas(raw_dir: Path, skip_unlabelled: bool = False) -> list[RawCase]:
    """ATLAS v2.0 BIDS (``Training/R*/sub-*/ses-*/anat/*_T1w.nii.gz`` + ``*_label-L_desc-T1lesion_mask.nii.gz``) or,
    where the folder holds no v2.0 image, the R1.x release the paper used (:func:`find_atlas_r1`)."""
    cases = []
    for image in sorted(raw_dir.rglob("*_T1w" + NII)):
        if "Testing" in _relative_parts(image, raw_dir):  # v2.0 test masks are hidden
            continue
        case_id = image.name.split("_")[0]
        label = image.with_name(image.name.replace("_T1w" + NII, "_label-L_desc-T1lesion_mask" + NII))
        label = _label_or_missing(case_id, label, skip_unlabelled)
        if label is not None:
            site = re.match(r"sub-(r\d+)", case_id)
            cases.append(RawCase(case_id, image, label, domain=site.group(1) if site else ""))
    if cases:
        return cases
    cases = find_atlas_r1(raw_dir, skip_unlabelled)
    if not cases:
        raise _no_cases(
            raw_dir,
            "Training/R001/sub-r001s001/ses-1/anat/sub-r001s001_ses-1_..._T1w.nii.gz (ATLAS v2.0) or "
            "Site1/031768/t01/031768_t1w_deface_stx.nii.gz + 031768_LesionSmooth_stx.nii.gz (ATLAS R1.x)",
        )
    return cases


#: ATLAS R1.x: ``<ID>_t1w_deface_stx`` (R1.1) or ``<ID>_t1w_stx`` (v1.2) images, lesion masks ``<ID>_LesionSmooth_stx``
#: and ``<ID>_LesionSmooth_<k>_stx`` (one file per further lesion) in the same folder, ``.nii.gz`` or ``.nii``
_ATLAS_R1_IMAGE = re.compile(r"^(?P<id>.+?)_t1w(_deface)?_stx\.nii(\.gz)?$")
ATLAS_R1_THRESHOLD = 0.5
"""R1.x lesion masks are binarised at > 0.5, as the public loaders do (DATASETS.md: "Masks are thresholded (>0.5)
by some loaders; check value range"); a 0/1 or 0/255 mask is unchanged by it."""


def find_atlas_r1(raw_dir: Path, skip_unlabelled: bool = False) -> list[RawCase]:
    """ATLAS R1.x (``Site<k>/<ID>/t01/<ID>_t1w_deface_stx.nii.gz`` + ``<ID>_LesionSmooth_stx.nii.gz`` and
    ``<ID>_LesionSmooth_<k>_stx.nii.gz`` for further lesions; v1.2's ``<ID>_t1w_stx`` naming too): one case per
    subject, its first scan (R1.1 has 229 scans of 220 subjects; the paper used 220 images), its lesion files
    united and binarised at :data:`ATLAS_R1_THRESHOLD`. The domain is the ``Site<k>`` folder where there is one.

    This layout is the one public loaders read, not confirmed by an official description (DATASETS.md).
    """
    scans: dict[str, list[tuple[Path, str]]] = {}
    for image in sorted(raw_dir.rglob("*_stx.nii*")):
        match = _ATLAS_R1_IMAGE.match(image.name)
        if match is None or not image.is_file():
            continue
        scan_id = match.group("id")
        subject = re.sub(r"t\d+$", "", scan_id) if re.fullmatch(r"c\d+s\d+t\d+", scan_id) else scan_id
        scans.setdefault(subject, []).append((image, scan_id))
    subjects = sorted(scans.items())
    repeated = [f"{subject} ({len(found)})" for subject, found in subjects if len(found) > 1]
    if repeated:
        logger.info("ATLAS R1.x: the first scan is used of each subject with several (scans): %s",
                    ", ".join(repeated))  # fmt: skip
    cases = []
    for subject, found in subjects:
        image, scan_id = found[0]  # sorted paths: t01 before t02
        masks = sorted(
            p for p in image.parent.glob(f"{scan_id}_LesionSmooth*_stx.nii*")
            if re.fullmatch(rf"{re.escape(scan_id)}_LesionSmooth(_\d+)?_stx\.nii(\.gz)?", p.name)
        )  # fmt: skip
        main = [p for p in masks if "_LesionSmooth_stx" in p.name]  # the first lesion's file, where there is one
        label = next(iter(main + masks), image.with_name(f"{scan_id}_LesionSmooth_stx" + NII))
        label = _label_or_missing(subject, label, skip_unlabelled)
        if label is None:
            continue
        site = next((part for part in _relative_parts(image, raw_dir) if re.fullmatch(r"Site\d+", part)), "")
        extra = tuple(p for p in masks if p != label)
        cases.append(RawCase(subject, image, label, domain=site, subject=subject, extra_labels=extra,
                             label_threshold=ATLAS_R1_THRESHOLD))  # fmt: skip
    return cases


def find_kits19(raw_dir: Path, skip_unlabelled: bool = False) -> list[RawCase]:
    """KiTS19: ``case_XXXXX/imaging.nii.gz`` + ``segmentation.nii.gz`` (cases >= 210 have no labels)."""
    root = raw_dir / "data" if not any(raw_dir.glob("case_*")) and (raw_dir / "data").is_dir() else raw_dir
    cases = []
    for folder in sorted(p for p in root.glob("case_*") if p.is_dir()):
        image = folder / "imaging.nii.gz"
        if not image.is_file():
            raise PrepareError(f"case {folder.name}: imaging.nii.gz missing in {folder}")
        label = folder / "segmentation.nii.gz"
        number = re.search(r"\d+", folder.name)
        if not label.exists() and number and int(number.group()) >= 210:  # the unlabelled KiTS test images
            continue
        label = _label_or_missing(folder.name, label, skip_unlabelled)
        if label is not None:
            cases.append(RawCase(folder.name, image, label))
    if not cases:
        raise _no_cases(raw_dir, "case_00000/imaging.nii.gz and case_00000/segmentation.nii.gz (KiTS19 data/)")
    return cases


def find_btcv(raw_dir: Path, skip_unlabelled: bool = False) -> list[RawCase]:
    """BTCV: ``Training/img/imgNNNN.nii.gz`` + ``Training/label/labelNNNN.nii.gz`` (``Testing`` is unlabelled)."""
    cases = []
    for image in sorted(raw_dir.rglob("img*" + NII)):
        if image.parent.name != "img" or "Testing" in _relative_parts(image, raw_dir):
            continue
        number = image.name[len("img") : -len(NII)]
        case_id = f"btcv_{number}"
        label = _label_or_missing(case_id, image.parent.parent / "label" / f"label{number}{NII}", skip_unlabelled)
        if label is not None:
            cases.append(RawCase(case_id, image, label))
    if not cases:
        raise _no_cases(raw_dir, "Training/img/img0001.nii.gz and Training/label/label0001.nii.gz (BTCV RawData)")
    return cases


PROSTATE_SOURCE, PROSTATE_TARGET = "BMC", "I2CVB"
#: other names of the sites' folders (older SAML lists, DATASETS.md), read where the site's own name is absent
PROSTATE_SITE_ALIASES = {PROSTATE_SOURCE: ("ISBI_1.5",), PROSTATE_TARGET: ("HCRUDB",)}


def _prostate_site_folder(raw_dir: Path, site: str) -> Path:
    """The folder of ``site``: its name, else the first of its older names present (the case ids keep ``site``)."""
    names = (site, *PROSTATE_SITE_ALIASES[site])
    for name in names:
        if (raw_dir / name).is_dir():
            return raw_dir / name
    raise PrepareError(
        f"site folder {raw_dir / site} missing ({' or '.join(names)}): expected {raw_dir}/{site}/CaseNN.nii.gz"
    )


def find_prostate(raw_dir: Path, skip_unlabelled: bool = False) -> list[RawCase]:
    """Multi-site prostate: ``<SITE>/CaseNN.nii.gz`` + ``CaseNN_segmentation.nii.gz`` (BMC: ``_Segmentation``);
    the paper's source site BMC (A) and target site I2CVB (B), also read under their older folder names
    (:data:`PROSTATE_SITE_ALIASES`)."""
    cases = []
    for site in (PROSTATE_SOURCE, PROSTATE_TARGET):
        folder = _prostate_site_folder(raw_dir, site)
        for image in sorted(folder.glob("Case*" + NII)):
            if "egmentation" in image.name:
                continue
            stem = image.name[: -len(NII)]
            candidates = [folder / f"{stem}_segmentation{NII}", folder / f"{stem}_Segmentation{NII}"]
            found = next((c for c in candidates if c.is_file()), candidates[0])
            label = _label_or_missing(f"{site}_{stem}", found, skip_unlabelled)
            if label is not None:
                cases.append(RawCase(f"{site}_{stem}", image, label, domain=site))
    if not cases:
        raise _no_cases(raw_dir, "BMC/Case00.nii.gz + BMC/Case00_Segmentation.nii.gz and I2CVB/Case00.nii.gz ...")
    return cases


MSCMR_SOURCE, MSCMR_TARGET = "C0", "LGE"


def find_mscmrseg(raw_dir: Path, skip_unlabelled: bool = False) -> list[RawCase]:
    """MS-CMRSeg 2019: ``patientN_C0.nii.gz`` (bSSFP) and ``patientN_LGE.nii.gz`` with ``patientN_<SEQ>_manual``
    labels anywhere under the raw folder (the release keeps them in ``c0gt/``, ``lgegt/``); T2 is not used."""
    labels = {p.name: p for p in raw_dir.rglob("patient*_manual" + NII)}
    cases = []
    for image in sorted(raw_dir.rglob("patient*" + NII)):
        match = re.fullmatch(r"patient(\d+)_(C0|LGE)\.nii\.gz", image.name)
        if not match:
            continue
        number, sequence = int(match.group(1)), match.group(2)
        case_id = f"patient{number:02d}_{sequence}"  # zero-padded: the paper's splits follow patient numbers
        expected = labels.get(
            f"patient{number}_{sequence}_manual{NII}", image.with_name(f"{image.name[:-7]}_manual{NII}")
        )
        label = _label_or_missing(case_id, expected, skip_unlabelled)
        if label is not None:
            cases.append(RawCase(case_id, image, label, domain=sequence))
    if not cases:
        raise _no_cases(raw_dir, "patient1_C0.nii.gz, patient1_LGE.nii.gz and their *_manual.nii.gz labels")
    return cases


MNMS_FOLDERS = ("Training", "Validation", "Testing")
MNMS_UNSEEN_CENTRE = "5"


def read_mnms_table(raw_dir: Path) -> dict[str, dict[str, str]]:
    """``{External code: row}`` from the M&Ms information CSV (columns ``External code``, ``Centre``, ``ED``,
    ``ES``)."""
    for path in sorted(raw_dir.rglob("*.csv")):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        if rows and {"External code", "Centre", "ED", "ES"} <= set(rows[0]):
            return {row["External code"].strip(): row for row in rows}
    raise PrepareError(
        f"no M&Ms information table under {raw_dir}: expected a CSV with columns 'External code', 'Centre', "
        "'ED', 'ES' (211230_M&Ms_Dataset_information_diagnosis_opendataset.csv)"
    )


def _frame(code: str, row: dict[str, str], phase: str) -> int:
    try:
        return int(float(row[phase]))
    except (TypeError, ValueError) as err:
        raise PrepareError(
            f"case {code}: {phase} frame {row.get(phase)!r} in the information table is not a number"
        ) from err


def find_mnms(raw_dir: Path, skip_unlabelled: bool = False) -> list[RawCase]:
    """M&Ms: ``<Training/Labeled|Training/Unlabeled|Validation|Testing>/<CODE>/<CODE>_sa.nii.gz`` + ``_sa_gt``;
    two 3D volumes per subject, the ED and ES frames named by the information CSV (0-based)."""
    table = read_mnms_table(raw_dir)
    cases = []
    for image in sorted(raw_dir.rglob("*_sa" + NII)):
        parts = _relative_parts(image, raw_dir)
        folder = next((p for p in parts if p in MNMS_FOLDERS), "")
        code = image.name[: -len("_sa" + NII)]
        if code not in table:
            raise PrepareError(f"case {code}: not in the M&Ms information table (ED/ES frames unknown)")
        label = image.with_name(f"{code}_sa_gt{NII}")
        unlabelled_by_design = "Unlabeled" in parts
        if not label.is_file() and unlabelled_by_design:
            continue
        label = _label_or_missing(code, label, skip_unlabelled)
        if label is None:
            continue
        row = table[code]
        for phase in ("ED", "ES"):
            cases.append(
                RawCase(
                    f"{code}_{phase}",
                    image,
                    label,
                    domain=str(row["Centre"]).strip(),
                    folder=folder,
                    frame=_frame(code, row, phase),
                    subject=code,
                    optional=unlabelled_by_design,
                )
            )
    if not cases:
        raise _no_cases(raw_dir, "Training/Labeled/<CODE>/<CODE>_sa.nii.gz and <CODE>_sa_gt.nii.gz (M&Ms)")
    return cases
