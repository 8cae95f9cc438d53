"""The TEA op-value benchmark: known answers with a network that commutes with every flip and quarter turn."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import load_benchmark
from jcsaug.data import make_synthetic_dataset
from jcsaug.ops.tea import TEA_OPS

#: ops with an exact inverse that a voxel-wise network commutes with: their copies predict what the plain image does
EXACT = [op.name for op in TEA_OPS if op.kind in ("flip", "rot90")]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_tea_op_value")


class _Voxelwise(torch.nn.Module):
    """Logits from each voxel alone (a 1x1x1 convolution): commutes with flips and quarter turns, not with intensity
    changes."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(1, 2, 1)
        with torch.no_grad():
            self.conv.weight.copy_(torch.tensor([-4.0, 4.0]).view(2, 1, 1, 1, 1))
            self.conv.bias.copy_(torch.tensor([1.0, -1.0]))

    def forward(self, x):
        return self.conv(x)


def _volumes(n=2, size=16):
    volumes = []
    for i in range(n):
        label = torch.zeros(1, 1, size, size, size)
        label[..., 3 + i : 9 + i, 4:8, 5:12] = 1
        volumes.append((label * 1.0 + 0.1 * torch.randn(label.shape, generator=torch.Generator().manual_seed(i)),
                        label))  # fmt: skip
    return volumes


def test_ops_the_network_commutes_with_gain_nothing_on_volumes_and_patches(bench):
    torch.manual_seed(0)
    from monai.inferers import SimpleInferer

    net, volumes = _Voxelwise().eval(), _volumes()
    with torch.no_grad():
        gains = bench.op_gains(net, volumes, SimpleInferer(), 2, torch.device("cpu"), progress=False)
        patches = bench.lesion_patches(volumes, [8, 8, 8], 5)
        background = bench.lesion_patches(volumes, [8, 8, 8], 5, background=True)
        effects = bench.patch_effects(net, patches, torch.device("cpu"), background)
    assert set(gains) == set(effects) == {op.name for op in TEA_OPS[1:]}
    for name in EXACT:  # mapped back exactly: a missing or wrong inverse breaks this
        assert gains[name] == pytest.approx((0.0, 0.0), abs=1e-9), name
        assert effects[name] == pytest.approx((0.0,) * len(bench.PATCH_SCORES), abs=1e-5), name
    assert gains["noise_0.125"] != (0.0, 0.0) and effects["gamma_expand_0.5"][0] != 0.0  # the others do change it
    # an intensity op keeps every voxel in view: both columns agree; a zoom in is scored on its centre in the second
    assert effects["gamma_expand_0.5"][0] == pytest.approx(effects["gamma_expand_0.5"][1], abs=1e-6)
    assert abs(effects["scale_up_0.45"][0] - effects["scale_up_0.45"][1]) > 0.1
    # the third column reads the volume's range: a gamma bends the patch otherwise, a spatial op is unchanged
    assert abs(effects["gamma_expand_0.5"][2] - effects["gamma_expand_0.5"][1]) > 1e-3
    assert effects["scale_up_0.45"][2] == pytest.approx(effects["scale_up_0.45"][1], abs=1e-6)
    # pooled with a background patch: another score (the background's false positives count), spatial ops too
    assert abs(effects["gamma_expand_0.5"][3] - effects["gamma_expand_0.5"][2]) > 1e-3
    assert sum(float(y.sum()) for _, y, _ in background) < sum(float(y.sum()) for _, y, _ in patches)
    assert len(patches) == 5 and all(x.shape == y.shape == (1, 1, 8, 8, 8) for x, y, _ in patches)
    assert all(y[0, 0, 4, 4, 4] == 1 for _, y, _ in patches)  # lesion-centred
    for (_, _, stats), k in zip(patches, range(5)):  # each patch carries its volume's statistics
        volume = volumes[k % len(volumes)][0]
        assert stats["min"].item() == pytest.approx(volume.min().item())
        assert stats["max"].item() == pytest.approx(volume.max().item())


def _trained_run(bench, tmp_path):
    """A tiny dataset and a run folder with a checkpoint of the bundle's network and a policies.json whose learned
    rank of op k is k + 1."""
    torch.set_num_threads(1)
    data, run = tmp_path / "data", tmp_path / "run"
    make_synthetic_dataset(data, num_train=1, num_val=1, num_test=1, shape=(32, 32, 32), progress=False)
    from monai.bundle import ConfigParser

    config = ConfigParser()
    config.read_config(str(bench.SYNTHETIC_TRAIN))
    torch.manual_seed(0)
    run.mkdir()
    torch.save({"network": config.get_parsed_content("network_def", lazy=False).state_dict()},
               run / "checkpoint_final_iteration=1.pt")  # fmt: skip
    probs = {op.name: 1.0 / (op.id + 1) for op in TEA_OPS}
    (run / "policies.json").write_text(json.dumps({"tea": {"ops": [{"name": n, "probability": p}
                                                                   for n, p in probs.items()]}}))  # fmt: skip
    return data, run


def test_main_ranks_ops_and_reads_the_learned_ranks(bench, tmp_path, capsys):
    """End to end on a tiny dataset (the learned rank of op k is k + 1)."""
    data, run = _trained_run(bench, tmp_path)
    out = tmp_path / "table.md"
    rows = bench.main(["--dataset-dir", str(data), "--run-dir", str(run), "--top", "3", "--patch-size", "16", "16",
                       "16", "--patches", "2", "--out", str(out)])  # fmt: skip
    undoing = ["rotate_frontal_cw_90", "mirror_sagittal", "gamma_compress_0.5"]  # the default shift's, best first
    assert [r[1] for r in rows][1:] == undoing[1:] and rows[0][1] in ("rotate_frontal_acw_90", undoing[0])
    names = [op.name for op in TEA_OPS]
    for _, name, _, rank, learned in rows:
        assert 1 <= rank <= len(TEA_OPS) - 1
        assert learned == min(
            names.index(n) + 1
            for n in ([name] if "90" not in name else ["rotate_frontal_acw_90", "rotate_frontal_cw_90"])
        )
    printed = capsys.readouterr().out
    assert "Spearman(learned probability, pair gain)" in printed and "patch loss" in printed
    assert "Spearman(patch loss in view, volume stats, falling; pair gain)" in printed
    assert "Spearman(patch loss pooled with a background patch, falling; pair gain)" in printed
    assert "Spearman(patch loss with identity, hard, falling; pair gain)" in printed
    assert out.read_text().count("\n") == 2 + len(rows)


def test_selection_dice_and_top_ops(bench):
    from monai.inferers import SimpleInferer

    net, volumes = _Voxelwise().eval(), _volumes()
    args = (net, volumes, SimpleInferer(), 2, torch.device("cpu"))
    with torch.no_grad():
        plain = bench.selection_dice(*args, [])  # the identity alone: the plain prediction
        assert bench.selection_dice(*args, EXACT[:4]) == pytest.approx(plain, abs=1e-9)  # commuting ops change nothing
        assert bench.selection_dice(*args, ["noise_0.125", "gamma_expand_0.5"]) != pytest.approx(plain, abs=1e-6)
    assert bench.top_ops({"a": 0.1, "b": 0.3, "c": -1.0, "d": 0.3}, 3) == ["b", "d", "a"]


def test_selections_compare_the_learned_choice_with_exhaustive_ones(bench, tmp_path, capsys):
    """On the validation split itself, choosing by the validation's pair gains is choosing by the split's: equal."""
    data, run = _trained_run(bench, tmp_path)
    out = tmp_path / "table.md"
    bench.main(["--dataset-dir", str(data), "--run-dir", str(run), "--split", "validation", "--selections",
                "--tea-z", "4", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if "TTA Dice, identity + 3 ops chosen by" in x)
    dice = dict(part.rsplit(" ", 1) for part in line.split("chosen by: ")[1].split(", "))
    assert list(dice) == list(bench.SELECTIONS)
    assert dice["validation pair"] == dice["split pair (ceiling)"]
    chosen = next(x for x in printed.splitlines() if "ops chosen by validation pair > 0" in x)
    count = int(chosen.split("(")[1].split(")")[0])
    assert 0 <= count <= 3
    if count == 0:  # no op's pair helps on the validation volumes: the TTA is the plain prediction
        assert dice["validation pair > 0"] == dice["no TTA"]
    table = out.read_text().split("\n\n")[1].splitlines()
    assert table[0].count("|") == len(bench.SELECTIONS) + 2 and len(table) == 3


def test_the_pair_column_is_what_the_updater_scores_with_identity_hard(bench):
    """The last patch column is the change of the updater's ``with-identity-hard`` score (in view, the volume's
    statistics) against the untouched copy, averaged over the patches: for every op, in view or not."""
    from jcsaug.engine import TEAPolicyUpdater
    from jcsaug.policy import make_tea_policy

    torch.manual_seed(0)
    net, volumes = _Voxelwise().eval(), _volumes()
    net.conv.weight.data.mul_(0.3)  # softer logits: intensity ops and zooms move the argmax on some voxels
    with torch.no_grad():
        patches = bench.lesion_patches(volumes, [8, 8, 8], 4)
        effects = bench.patch_effects(net, patches, torch.device("cpu"))
    updater = TEAPolicyUpdater(make_tea_policy("nnunet"), net, None, op_score="with-identity-hard",
                               mask_out_of_view=True)  # fmt: skip
    ops = list(TEA_OPS[1:])
    scores = torch.stack([updater._mapped_back_dice(x[0], y[0], ops, stats) for x, y, stats in patches])
    expected = 100 * (scores[:, 1:] - scores[:, :1]).mean(0)
    column = torch.tensor([effects[op.name][-1] for op in ops], dtype=expected.dtype)
    assert torch.allclose(column, expected, atol=1e-6)
    assert expected.abs().max() > 0.5  # some op changes the segmentation: the comparison is not of zeros
    assert all(torch.isnan(torch.tensor(effects[op.name][3])) for op in ops)  # no background given: no pooled score


def test_the_difference_of_two_splits_is_printed_for_the_ops_named(bench, tmp_path, capsys):
    """``--minus-split``: each named op's alone gain on ``--split``, on the other split and their difference, the
    same numbers as ``op_gains`` gives on each split's volumes; ``--ops`` limits the ops, an unknown name is refused
    naming it."""
    data, run = _trained_run(bench, tmp_path)
    names = ["rotate_frontal_cw_90", "gamma_expand_0.5"]
    bench.main(["--dataset-dir", str(data), "--run-dir", str(run), "--split", "validation", "--minus-split",
                "training", "--max-volumes", "1", "--ops", *names, "--top", "5"])  # fmt: skip
    printed = capsys.readouterr().out
    block = printed.split("alone gain on validation minus on training (1 volumes):\n")[1].splitlines()[: len(names)]
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in block}
    assert set(rows) == set(names)
    for here, there, difference in rows.values():
        assert difference == pytest.approx(here - there, abs=0.011)
    assert "shift-undoing mirror_sagittal" not in printed and "shift-undoing rotate_frontal" in printed  # --ops
    with pytest.raises(SystemExit):
        bench.main(["--dataset-dir", str(data), "--run-dir", str(run), "--ops", "rotate_sideways"])
    assert "no TEA op named 'rotate_sideways'" in capsys.readouterr().err
