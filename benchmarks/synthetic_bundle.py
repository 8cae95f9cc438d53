"""Where the benchmarks find the synthetic bundle (``bundles/synthetic_lesion``), and its own defaults.

One place for the path, so a benchmark never keeps a copy of it; scripts in this folder import it as a sibling
module (``from synthetic_bundle import SYNTHETIC_TRAIN``), as Python puts a script's own folder on ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
#: the synthetic bundle's ``configs`` folder
SYNTHETIC_CONFIGS = ROOT / "bundles" / "synthetic_lesion" / "configs"
#: its training config, the one the README's first command runs
SYNTHETIC_TRAIN = SYNTHETIC_CONFIGS / "train.yaml"


def synthetic_config(path: Path | None = None) -> dict[str, Any]:
    """A bundle training config as a plain mapping (``path``; default the synthetic bundle's ``train.yaml``)."""
    return yaml.safe_load((SYNTHETIC_TRAIN if path is None else Path(path)).read_text())


def bundle_default(key: str) -> Any:
    """The synthetic bundle's own default of ``key`` (read from its ``train.yaml``)."""
    config = synthetic_config()
    if key not in config:
        raise KeyError(f"{SYNTHETIC_TRAIN} has no setting {key!r}")
    return config[key]
