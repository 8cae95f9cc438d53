"""What the dataset bundles read at run time: their SPEC §6 setting for (network, training fraction) and the
prepared datalist's splits."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from monai.data import load_decathlon_datalist

from jcsaug.tasks.prepare import DATALIST_NAME

__all__ = ["bundle_task", "load_split", "paper_setting", "read_datalist"]

#: the key of a dataset bundle's ``configs/metadata.json`` that names its task
BUNDLE_TASK_KEY = "jcsaug_task"

logger = logging.getLogger(__name__)


def paper_setting(
    table: Mapping[str, Mapping[str, Sequence]], network: str, train_fraction: float
) -> tuple[str, float]:
    """``(val_loss, tra_lr)`` = (L_val, β) of ``network`` at ``train_fraction`` from a bundle's table
    ``{network: {"0.5": [L_val, beta], "1.0": [L_val, beta]}}``.

    Where the paper has no entry the nearest training fraction of that network is used, or the table's first
    network, with a warning saying which (the paper did not run every task with every network).
    """
    if not table:
        raise ValueError("the settings table is empty")
    fraction = float(train_fraction)
    if network in table:
        row, used = table[network], network
    else:
        used = next(iter(table))
        row = table[used]
    key = min(row, key=lambda k: abs(float(k) - fraction))
    if used != network or float(key) != fraction:
        logger.warning(
            "the paper has no L_val/beta for %s at %.0f%% training data; using those of %s at %.0f%%",
            network, 100 * fraction, used, 100 * float(key),
        )  # fmt: skip
    val_loss, beta = row[key]
    return str(val_loss), float(beta)


def bundle_task(metadata: Mapping) -> str:
    """The task a dataset bundle runs: ``metadata.json``'s ``"jcsaug_task"`` (MONAI reads the bundle's
    ``configs/metadata.json`` next to its ``train.yaml`` unless ``--meta_file`` says otherwise)."""
    from jcsaug.tasks.registry import list_tasks

    task = metadata.get(BUNDLE_TASK_KEY) if isinstance(metadata, Mapping) else None
    if not task:
        raise ValueError(
            f"no task: the bundle's metadata.json has no {BUNDLE_TASK_KEY!r} (pass --meta_file "
            f"bundles/<task>/configs/metadata.json, or --task with one of {', '.join(list_tasks())})"
        )
    return str(task)


def read_datalist(dataset_dir: str | Path, task: str | None = None) -> dict:
    """The ``dataset.json`` written by ``jcsaug prepare`` (clear errors if it is missing or of another task)."""
    path = Path(dataset_dir) / DATALIST_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: prepare the data first with "
            f"`jcsaug prepare {task or 'TASK'} RAW_DIR --out {dataset_dir}`"
        )
    data = json.loads(path.read_text())
    if task is not None and data.get("name") != task:
        raise ValueError(f"{path} was prepared for task {data.get('name')!r}, not {task!r}")
    return data


def load_split(dataset_dir: str | Path, split: str, task: str | None = None, train_fraction: float = 1.0) -> list[dict]:
    """Cases of one split with absolute paths (``training`` with ``train_fraction=0.5`` -> ``training_50``)."""
    data = read_datalist(dataset_dir, task)
    key = split
    if split == "training" and float(train_fraction) != 1.0:
        key = f"training_{round(100 * float(train_fraction))}"
    if key not in data:
        splits = [k for k, v in data.items() if isinstance(v, list)]
        hint = " (the paper has reduced-data runs for atlas_stroke and kits19_tumor only)" if key != split else ""
        raise ValueError(f"{Path(dataset_dir) / DATALIST_NAME} has no split {key!r}{hint}; it has {splits}")
    return load_decathlon_datalist(Path(dataset_dir) / DATALIST_NAME, data_list_key=key, base_dir=dataset_dir)
