"""Finding a run's checkpoints."""

from __future__ import annotations

import re
from pathlib import Path

_NUMBER = re.compile(r"=(\d+)\.pt$")


def latest_checkpoint(output_dir: str | Path) -> Path:
    """The newest MONAI ``CheckpointSaver`` file in ``output_dir``: the final one if present, else the one
    with the highest epoch/iteration number."""
    output_dir = Path(output_dir)
    candidates = sorted(output_dir.glob("checkpoint_*.pt"))
    if not candidates:
        raise FileNotFoundError(f"no checkpoint_*.pt in {output_dir}: train first (configs/train.yaml)")
    final = [p for p in candidates if "final" in p.name]

    def number(p: Path) -> int:
        m = _NUMBER.search(p.name)
        return int(m.group(1)) if m else -1

    return max(final or candidates, key=lambda p: (number(p), p.stat().st_mtime))
