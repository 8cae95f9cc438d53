"""The paper's six dataset tasks (SPEC §6, DATASETS.md) by name: ``register_task``, ``get_task``, ``list_tasks``.

Everything the bundles need to know about a task lives here, in its :class:`TaskSpec`: classes, spacing, raw
layout, split rule, and the paper's training settings (L_val and beta per network and training fraction, patch
sizes, epochs, whether the final models train on training + validation cases). The paper's L_val "DSC" is
``batch-dice`` and "DSC+CE" ``ce+batch-dice``: its code's soft Dice is one Dice over the validation batch's
foreground classes (REFERENCE_CODE_NOTES §2.3), not the mean of per-patch Dice (``dice``), which would score each
background-centred patch on its few foreground voxels.
"""

from __future__ import annotations

from jcsaug.registry import Registry
from jcsaug.tasks import layouts
from jcsaug.tasks.spec import PrepareError, RawCase, TaskSpec
from jcsaug.tasks.splits import half_subset, ordered_split, random_split

__all__ = ["TASKS", "get_task", "list_tasks", "register_task"]


def _random_rule(train: int, val: int, test: int, half: int | None = None):
    """Seeded random training/validation/test split; ``training_50`` too when the paper has a 50 % variant."""

    def rule(cases: list[RawCase], seed: int) -> dict[str, list[str]]:
        splits = random_split(cases, {"training": train, "validation": val, "test": test}, seed)
        if half is not None:
            splits["training_50"] = half_subset(splits["training"], half, train, seed)
        return splits

    return rule


def _cross_domain_rule(source: str, target: str, source_sizes: dict, target_sizes: dict, random_target: bool):
    """Source-domain cases in id order to ``source_sizes``, target-domain cases to ``target_sizes`` (in id order,
    or seeded random where the paper picked its target validation case at random)."""

    def rule(cases: list[RawCase], seed: int) -> dict[str, list[str]]:
        splits = ordered_split([c for c in cases if c.domain == source], source_sizes, f"{source} cases")
        chosen = [c for c in cases if c.domain == target]
        if random_target:
            splits.update(random_split(chosen, target_sizes, seed))
        else:
            splits.update(ordered_split(chosen, target_sizes, f"{target} cases"))
        return splits

    return rule


def _mnms_rule(unseen_centre: str = layouts.MNMS_UNSEEN_CENTRE):
    """M&Ms by the dataset's folders: train on ``Training`` (seen centres), validate and test on the unseen
    centre's ``Validation`` and ``Testing`` cases; ``test_seen`` = ``Testing`` cases of the other centres."""

    def rule(cases: list[RawCase], seed: int) -> dict[str, list[str]]:
        def pick(folder: str, unseen: bool) -> list[str]:
            return sorted(c.case_id for c in cases if c.folder == folder and (c.domain == unseen_centre) == unseen)

        splits = {
            "training": pick("Training", False),
            "validation": pick("Validation", True),
            "test": pick("Testing", True),
            "test_seen": pick("Testing", False),
        }
        for name in ("training", "validation", "test"):
            if not splits[name]:
                raise PrepareError(
                    f"M&Ms split {name!r} is empty: check the Training/Validation/Testing folders "
                    f"and that centre {unseen_centre} (the unseen domain) has Validation/Testing cases"
                )
        return splits

    return rule


BTCV_ORGANS = {
    0: "background", 1: "spleen", 2: "right kidney", 3: "left kidney", 4: "gallbladder", 5: "oesophagus",
    6: "liver", 7: "stomach", 8: "aorta", 9: "inferior vena cava", 10: "portal and splenic veins",
    11: "pancreas", 12: "right adrenal gland", 13: "left adrenal gland",
}  # fmt: skip
CARDIAC = {0: "background", 1: "LV blood pool", 2: "LV myocardium", 3: "RV blood pool"}
#: the paper's cardiac MR patches: thin in the slice direction (UNETR needs multiples of 16)
CARDIAC_PATCHES = {"unet3d": (128, 128, 8), "transformer": (128, 128, 16)}

#: task name -> :class:`TaskSpec`
TASKS: Registry[TaskSpec] = Registry("task")


#: ``register_task(spec)`` makes a dataset task available by name (``jcsaug prepare``, the bundles' ``task``);
#: ``get_task(name)`` and ``list_tasks()`` look them up
register_task, get_task, list_tasks = TASKS.register, TASKS.get, TASKS.names


for _spec in (
    TaskSpec(
        name="atlas_stroke",
        title="ATLAS (v2.0 or R1.x) T1 MR chronic stroke lesions",
        modality="MR",
        labels={0: "background", 1: "lesion"},
        spacing=(1.0, 1.0, 1.0),
        orientation="RAS",
        find_cases=layouts.find_atlas,
        layout="ATLAS_2/Training/R*/sub-*/ses-1/anat/*_T1w.nii.gz + *_label-L_desc-T1lesion_mask.nii.gz (v2.0), "
        "or Site*/<ID>/t01/<ID>_t1w_deface_stx.nii.gz + <ID>_LesionSmooth[_k]_stx.nii.gz (R1.x)",
        assign_splits=_random_rule(145, 31, 44, half=73),
        report_classes={"lesion": (1,)},
        single_component_classes=(),  # stroke lesions: often several per brain
        source="https://fcon_1000.projects.nitrc.org/indi/retro/atlas.html (ATLAS R2.0 or R1.1, after accepting the "
        "terms)",
        paper_settings={
            "deepmedic": {0.5: ("batch-dice", 1e-3), 1.0: ("batch-dice", 2e-3)},
            "unet3d": {0.5: ("batch-dice", 5e-4), 1.0: ("ce", 1e-3)},
            "transformer": {0.5: ("batch-dice", 1e-3)},
        },
    ),
    TaskSpec(
        name="kits19_tumor",
        title="KiTS19 contrast CT, kidney and tumour",
        modality="CT",
        labels={0: "background", 1: "kidney", 2: "tumour"},
        spacing=(1.6, 1.6, 3.2),
        orientation="RAS",
        find_cases=layouts.find_kits19,
        layout="kits19/data/case_XXXXX/imaging.nii.gz + segmentation.nii.gz",
        assign_splits=_random_rule(140, 28, 42, half=70),
        report_classes={"tumour": (2,)},
        single_component_classes=(),  # "kidney" is both kidneys; tumours may be multifocal
        source="https://github.com/neheller/kits19 (python -m starter_code.get_imaging)",
        paper_settings={
            "deepmedic": {0.5: ("batch-dice", 1e-3), 1.0: ("batch-dice", 1e-3)},
            "unet3d": {0.5: ("ce+batch-dice", 5e-4), 1.0: ("ce", 5e-4)},
            "transformer": {0.5: ("ce", 2e-3)},
        },
        max_epochs=2000,  # the paper: KiTS needed more iterations to converge
        roi_threshold=-200.0,  # the reference code's body mask (DATASETS.md): HU > -200, largest component, filled
    ),
    TaskSpec(
        name="btcv_abdomen",
        title="BTCV abdominal CT, 13 organs",
        modality="CT",
        labels=BTCV_ORGANS,
        spacing=(1.6, 1.6, 3.2),
        orientation="RAS",
        find_cases=layouts.find_btcv,
        layout="Abdomen/RawData/Training/img/img00NN.nii.gz + Training/label/label00NN.nii.gz",
        assign_splits=_random_rule(20, 4, 6),
        # the paper: "Organ" (all 13) and "Organ_r" (GB, E, AO, IVC, V, PA, RA, LA)
        report_classes={"organs": tuple(range(1, 14)), "rare organs": (4, 5, 8, 9, 10, 11, 12, 13)},
        # every label is one structure: kidneys and adrenal glands are labelled per side, the splenic vein joins the
        # portal vein (thin vessels and glands may still be split at 3.2 mm slices: check on validation cases)
        single_component_classes=tuple(range(1, 14)),
        source="https://www.synapse.org/#!Synapse:syn3193805 (Synapse account, join the challenge)",
        paper_settings={"deepmedic": {1.0: ("ce", 2e-3)}, "unet3d": {1.0: ("batch-dice", 5e-4)}},
    ),
    TaskSpec(
        name="prostate_crosssite",
        title="prostate T2 MR, site A (BMC, 1.5T) -> site B (I2CVB, 3T)",
        modality="MR",
        labels={0: "background", 1: "prostate"},
        spacing=(0.8, 0.8, 1.5),
        orientation="RAS",
        find_cases=layouts.find_prostate,
        layout="Processed_data_nii/{BMC,I2CVB}/CaseNN.nii.gz + CaseNN_segmentation.nii.gz (BMC: _Segmentation)",
        assign_splits=_cross_domain_rule(
            layouts.PROSTATE_SOURCE,
            layouts.PROSTATE_TARGET,
            {"training": 20, "test_source": 6},
            {"validation": 1, "test": 18},
            random_target=False,  # the reference lists: I2CVB Case00 validates
        ),
        report_classes={"prostate": (1,)},
        single_component_classes=(1,),
        binarise_labels=True,  # some masks contain 2 or more (SAML maps 2 -> 1; the reference code binarises > 0)
        copy_image_geometry_to_label=True,
        source="https://liuquande.github.io/SAML/ (Processed_data_nii)",
        paper_settings={"deepmedic": {1.0: ("ce", 5e-4)}, "unet3d": {1.0: ("ce", 5e-4)}},
        patch_sizes={"unet3d": (64, 64, 32), "transformer": (64, 64, 32)},
        train_on_val=True,  # the paper's final models: train + the site-B validation case
    ),
    TaskSpec(
        name="cardiac_crosssequence",
        title="MS-CMRSeg 2019 cardiac MR, bSSFP -> LGE",
        modality="MR",
        labels=CARDIAC,
        spacing=(1.25, 1.25, 0.0),  # in-plane only: slices stay as acquired
        nominal_spacing=(1.25, 1.25, 10.0),  # networks are planned for a typical 8-13 mm slice spacing
        orientation=None,
        find_cases=layouts.find_mscmrseg,
        layout="patientN_{C0,LGE}.nii.gz + patientN_{C0,LGE}_manual.nii.gz anywhere below RAW_DIR",
        assign_splits=_cross_domain_rule(
            layouts.MSCMR_SOURCE,
            layouts.MSCMR_TARGET,
            {"training": 30, "test_source": 10},
            {"validation": 1, "test": 44},
            random_target=True,  # the paper: one LGE case, at random
        ),
        report_classes={"AVG": (1, 2, 3), "LV": (1,), "MYO": (2,), "RV": (3,)},  # the paper's columns
        single_component_classes=(1, 2, 3),  # LV blood pool, myocardium (a ring, one structure), RV blood pool
        label_map={0: 0, 500: 1, 200: 2, 600: 3},
        source="https://zmiclab.github.io/zxh/0/mscmrseg19/ (registration)",
        paper_settings={"unet3d": {1.0: ("ce", 5e-4)}},
        patch_sizes=CARDIAC_PATCHES,
        train_on_val=True,  # the paper's rows here are ‡: trained on train + the LGE validation case
    ),
    TaskSpec(
        name="cardiac_crosssite",
        title="M&Ms multi-vendor cardiac MR, unseen centre 5",
        modality="MR",
        labels=CARDIAC,
        spacing=(1.25, 1.25, 10.0),
        orientation=None,
        find_cases=layouts.find_mnms,
        layout="Training/Labeled/<CODE>/<CODE>_sa.nii.gz + _sa_gt.nii.gz, Validation/, Testing/ + information CSV",
        assign_splits=_mnms_rule(),
        report_classes={"AVG": (1, 2, 3), "LV": (1,), "MYO": (2,), "RV": (3,)},  # the paper's columns
        single_component_classes=(1, 2, 3),  # LV blood pool, myocardium (a ring, one structure), RV blood pool
        source="https://www.ub.edu/mnms/ (registration)",
        paper_settings={"unet3d": {1.0: ("batch-dice", 5e-4)}},
        patch_sizes=CARDIAC_PATCHES,
    ),
):
    register_task(_spec)
