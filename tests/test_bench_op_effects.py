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
    parser = bench.bundle_config(bench.SYNTHETIC_TRAIN, {"patch_size": PATCH})
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


def test_moves_keep_a_voxelwise_networks_gradient_norm_and_the_ratio_table(bench):
    """``--gradient-ratio``: a 1x1x1 convolution's loss is a mean over voxels, so mirrors and quarter turns give the
    patch's own gradient norm (ratio exactly 1), intensity ops another; every single op gets a row per group, best
    effect first, with the group's rank correlation."""
    torch.manual_seed(0)
    net = torch.nn.Conv3d(1, 2, 1)
    label = torch.zeros(4, 1, 8, 8, 8)
    label[:, :, 2:6, 3:5, 1:7] = 1
    images = label + 0.2 * torch.randn(label.shape)
    moves = ["rotate_frontal/rot90", "mirror_sagittal/flip", "rotate_longitudinal/rot90"]
    ops = [*moves, "gamma/gamma±[0.4,0.6)", "contrast/contrast±[0.2,0.3)"]
    plan = bench.plan_transforms(ops, [])
    v = {n: torch.randn_like(p) for n, p in net.named_parameters()}
    norms = {}
    loss = bench.get_loss("ce+dice")
    scores = bench.score_transforms(net, {1: (images, label)}, plan, [v], loss, norms=norms)
    assert set(norms[1]) == {"identity", *ops}
    plain = norms[1]["identity"]
    assert plain.shape == (4,) and (plain > 0).all()
    by_hand = torch.autograd.grad(loss(net(images[:1]), label[:1]).sum(), list(net.parameters()))
    assert plain[0] == pytest.approx(float(torch.sqrt(sum((g**2).sum() for g in by_hand))), rel=1e-5)
    rows = bench.gradient_ratio_rows(scores, norms, "s", {1: "lesion"})
    assert [r["transform"] for r in rows] == sorted(ops, key=lambda n: -(scores[1][n] - scores[1]["identity"]).mean())
    ratio = {r["transform"]: r["ratio"] for r in rows}
    for name in moves:
        assert ratio[name] == pytest.approx(1.0, abs=1e-5), name
    assert abs(ratio["gamma/gamma±[0.4,0.6)"] - 1.0) > 1e-4
    assert all(-1.0 <= r["rho"] <= 1.0 for r in rows)
    text = bench.format_ratio_table(rows, ["mirror_sagittal/flip"], markdown=True)
    assert "Spearman(effect, gradient ratio) over 5 ops" in text and text.count("(undoes the shift)") == 1
    assert len(bench.all_ops()) == 47 and bench.plan_transforms(bench.all_ops(), []).transforms.keys() >= set(ops)


def test_all_ops_with_the_gradient_ratio_end_to_end(bench, setup, tmp_path, capsys):
    torch.set_num_threads(1)
    data, checkpoint, _ = setup
    out = tmp_path / "effects.md"
    rows = bench.main(["--dataset-dir", str(data), "--checkpoint", str(checkpoint), "--patch-size", *map(str, PATCH),
                       "--patches-per-group", "1", "--val-directions", "1", "--ops", "all", "--gradient-ratio",
                       "--out", str(out)])  # fmt: skip
    ratios = [r for r in rows if "ratio" in r]
    assert len(ratios) == 2 * 47 and all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in ratios)
    assert "Spearman(effect, gradient ratio) over 47 ops" in capsys.readouterr().out
    assert out.read_text().count("(undoes the shift)") == 2 * 3  # the default shift's three ops, in both groups


def test_beyond_training_directions_are_orthogonal_to_the_source_gradient(bench, setup, capsys):
    """``--direction beyond-training``: the directions handed to the scores are orthogonal to the plain patches'
    training gradient (one per group's patches together), and the cosine with it is printed per state."""
    torch.set_num_threads(1)
    data, checkpoint, parser = setup
    args = bench.parse_args(["--dataset-dir", str(data), "--checkpoint", str(checkpoint), "--patch-size",
                             *map(str, PATCH), "--patches-per-group", "2", "--val-directions", "1",
                             "--ops", "mirror_sagittal/flip", "--direction", "beyond-training"])  # fmt: skip
    train = bench.load_split(parser, data, "training")
    patches = bench.sample_source_patches(train, bench.make_crop(parser, 0), parser.get_parsed_content(
        "class_group", lazy=False), 2, 0)  # fmt: skip
    val = bench.load_split(parser, data, "validation")
    plan = bench.plan_transforms(args.ops, [])
    seen = []
    original = bench.directional_scores

    def spy(model, directions, *rest):
        seen.append((model, directions))
        return original(model, directions, *rest)

    bench.directional_scores = spy
    try:
        _, line, _ = bench.measure_state(args, parser, checkpoint, patches, val, plan)
    finally:
        bench.directional_scores = original
    model, directions = seen[0]
    source = bench.source_gradient(model, patches, bench.get_loss(parser["train_loss"]))
    for v in directions:
        assert abs(float(bench.flat_dot(v, source))) < 1e-5 * float(bench.flat_norm(v) * bench.flat_norm(source))
    assert "cos(v, source gradient) = " in line


def test_the_signed_halves_of_split_signs_are_measured_each_with_its_one_sign(bench, setup, tmp_path):
    """``--ops`` takes ``scale-[0.4,0.5)`` (a magnification of 1.4-1.5) beside SPEC's signed op, whose indices stay
    SPEC's; a checkpoint of a ``split-signs`` run gives its learned policy for ``--context drawn``."""
    from jcsaug.policy import make_tra_policy

    assert bench.parse_op("scale/scale±[0.4,0.5)") == (0, 5)  # SPEC's index
    s, minus = bench.parse_op("scale/scale-[0.4,0.5)")
    _, plus = bench.parse_op("scale/scale+[0.4,0.5)")
    seeds = bench.patch_seeds(20, 1)
    down = bench.draw_params(seeds, [(s, minus)], [bench.TRAParams()] * 20)
    up = bench.draw_params(seeds, [(s, plus)], [bench.TRAParams()] * 20)
    assert all(1 / 1.5 < p.scale <= 1 / 1.4 for p in down) and all(1.4 <= p.scale < 1.5 for p in up)
    assert [round(p.scale * q.scale, 9) for p, q in zip(down, up)] == [1.0] * 20  # the same magnitude draws
    with pytest.raises(KeyError, match="scale"):
        bench.parse_op("scale/scale*[0.4,0.5)")
    _, checkpoint, parser = setup
    split = make_tra_policy("nnunet", 2, catalogue="split-signs")
    stored = tmp_path / "split.pt"
    torch.save({**torch.load(checkpoint, weights_only=False), "tra_updater": {"policy": split.state_dict()}}, stored)
    policy = bench.training_policy(parser, stored, 2)
    assert policy.op_names == split.op_names
    assert len(bench.draw_context(seeds, 1, policy, [0])) == 20
