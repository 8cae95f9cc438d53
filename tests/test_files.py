"""The one atomic write (jcsaug.utils.atomic_write): every writer goes through it, files get the umask's usual mode
(not mkstemp's 0600), data reach the disk (fsync) before the rename, and a failed write keeps the old file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from jcsaug.utils import atomic_write, atomic_write_text, file_mode


@pytest.fixture
def umask_002():
    old = os.umask(0o002)
    yield 0o664
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("umask, expected", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_files_get_the_umasks_mode(tmp_path, umask, expected):
    old = os.umask(umask)
    try:
        assert file_mode() == expected
        path = atomic_write_text(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert _mode(path) == expected and path.read_text() == "{}"


def test_every_writer_uses_the_umask_mode(tmp_path, umask_002):
    """metrics.json, per_case.csv, policies.json, dataset.json, images, checkpoints, report tables, pictures."""
    from monai.inferers import SimpleInferer

    from jcsaug.data import make_synthetic_dataset
    from jcsaug.engine import save_checkpoint_atomic
    from jcsaug.evaluation import build_report, evaluate_cases
    from jcsaug.policy import make_tea_policy, make_tra_policy
    from jcsaug.policy.io import save_policies
    from jcsaug.viz import plot_policy

    datalist = make_synthetic_dataset(tmp_path / "data", 1, 1, 1, shape=(16, 16, 16), progress=False)
    written = [datalist, *sorted((tmp_path / "data").rglob("*.nii.gz"))]
    net = torch.nn.Conv3d(1, 2, 1)

    def load(entry):
        return {k: torch.zeros(1, 8, 8, 8) + (k == "label") for k in ("image", "label")}

    evaluate_cases(net, [{"image": "a"}], load, {"none": SimpleInferer()}, 2, output_path=tmp_path / "metrics.json",
                   progress=False, spacing=1.0)  # fmt: skip
    written += [tmp_path / "metrics.json", tmp_path / "per_case.csv"]
    written.append(save_policies(tmp_path / "policies.json", make_tra_policy(), make_tea_policy()))
    written.append(save_checkpoint_atomic(tmp_path / "checkpoint.pt", {"network": net}))
    build_report([tmp_path], "none").to_csv(tmp_path / "report.csv")
    written.append(tmp_path / "report.csv")
    pytest.importorskip("matplotlib")
    written.append(plot_policy((make_tra_policy(), None), tmp_path / "policies.png"))
    assert {p.name: oct(_mode(p)) for p in written} == {p.name: oct(umask_002) for p in written}


def test_data_is_flushed_before_the_rename_and_a_failure_keeps_the_old_file(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append("replace") or real_replace(a, b))
    path = atomic_write_text(tmp_path / "x.txt", "old")
    assert events[:2] == ["fsync", "replace"]  # file data first; then the folder (the rename itself)

    def failing(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, failing)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["x.txt"]
