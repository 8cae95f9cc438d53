"""The op-effect benchmark on a tiny synthetic dataset and an untrained network (no bundle run here)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import load_benchmark
from jcsaug.data import make_synthetic_dataset

PATCH = [16, 16, 16]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_op_effects")


@pytest.fixture(scope="module")
def setup(bench, tmp_path_factory):
    """A tiny dataset and a checkpoint of an untrained network built from the bundle's config."""
    root = tmp_path_factory.mktemp("op_effects")
    data = root / "data"
    make_synthetic_dataset(data, num_train=2, num_val=2, num_test=1, shape=(32, 32, 32), progress=False)
    torch.manual_seed(0)
    parser = bench.bundle_config(bench.CONFIG, {"patch_size": PATCH})
    checkpoint = root / "checkpoint.pt"
    torch.save({"network": parser.get_parsed_content("network_def", lazy=False).state_dict()}, checkpoint)
    return data, checkpoint, parser


def test_one_finite_row_per_transform_and_group_identity_exactly_zero(bench, setup, tmp_path, capsys):
    torch.set_num_threads(1)
    data, checkpoint, _ = setup
    out = tmp_path / "effects.md"
    rows = bench.main(["--dataset-dir", str(data), "--checkpoint", str(checkpoint), "--patch-size", *map(str, PATCH),
                       "--patches-per-group", "3", "--val-directions", "1", "--out", str(out)])  # fmt: skip
    ops = ["rotate_frontal/rot90", "mirror_sagittal/flip", "gamma/gamma±[0.4,0.6)", "rotate_frontal/rotate±[20,30)"]
    pairs = [(a, b) for i, a in enumerate(ops[:3]) for b in ops[i + 1 : 3]]
    expected = {"s(identity)", "identity", *ops, *(f"{a}+{b}" for a, b in pairs), "+".join(ops[:3])}
    expected |= {f"interaction {a} x {b}" for a, b in pairs}
    keys = [(r["transform"], r["group"]) for r in rows]
    assert len(keys) == len(set(keys))  # one row per (transform, group)
    assert set(keys) == {(t, g) for t in expected for g in ("background", "lesion")}
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("effect", "se", "t")), r
        assert r["n"] == 3 and r["n_v"] == 1
    for r in (r for r in rows if r["transform"] == "identity"):
        assert r["effect"] == 0.0 and r["se"] == 0.0
    assert "positive = " in capsys.readouterr().out
    assert out.read_text().count("| `identity` |") == 2


@pytest.mark.parametrize("op", ["rotate_frontal/rot90", "mirror_sagittal/flip"])
def test_effect_is_the_norm_of_v_when_v_is_the_gradient_gap_of_the_transform(bench, setup, op):
    """With v = grad mean l_train(T(x)) - grad mean l_train(x) over a group's own patches, effect(T) = v.v/||v|| =
    ||v|| > 0 exactly: a sign error, or scores paired with the wrong patches, transform or group, breaks it."""
    torch.set_num_threads(1)
    data, checkpoint, parser = setup
    model = bench.build_network(parser, checkpoint, torch.device("cpu"))
    train = bench.load_split(parser, data, "training")
    grouper = parser.get_parsed_content("class_group", lazy=False)
    patches = bench.sample_source_patches(train, bench.make_crop(parser, 0), grouper, 4, 0)
    plan = bench.plan_transforms([op], [op])
    loss_fn = bench.get_loss(parser["train_loss"])
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for group, (images, labels) in patches.items():
        seeds = bench.patch_seeds(len(images), group)
        x, y = bench.apply_params(
            images, labels, bench.draw_params(seeds, plan.transforms[op], [bench.TRAParams()] * 4)
        )
        gap = torch.autograd.grad(loss_fn(model(x), y).mean() - loss_fn(model(images), labels).mean(), params)
        v = dict(zip(names, gap))
        scores = bench.score_transforms(model, {group: patches[group]}, plan, [v], loss_fn)
        rows = {r["transform"]: r for r in bench.summarise(scores, plan, "s", {group: "g"})}
        norm = float(bench.flat_norm(v)) * bench.SCALE
        assert norm > 0
        assert rows[op]["effect"] == pytest.approx(norm, rel=1e-3)
        assert rows["identity"]["effect"] == 0.0
