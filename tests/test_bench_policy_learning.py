"""The policy-learning cost benchmark times the synthetic bundle's own TRA settings (no timing here)."""

from __future__ import annotations

import pytest
import torch
import yaml
from monai.bundle import ConfigParser

from helpers import CONFIGS, load_benchmark, tiny_unet
from jcsaug.engine import POLICY_STEPS, TRAPolicyUpdater
from jcsaug.policy import make_tra_policy


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_policy_learning")


def test_section_5_times_the_bundles_own_tra_settings(bench, tmp_path):
    """Section 5's default row is read from the bundle's ``train.yaml`` (a changed default moves the row with it),
    and the former 6-batch setting is timed beside it."""
    parser = ConfigParser()
    parser.read_config(CONFIGS / "train.yaml")
    kwargs, copies, catalogue, label = bench.synthetic_tra_settings(CONFIGS / "train.yaml")
    assert kwargs == {"estimator": parser["tra_estimator"], "val_batches": parser["val_batches"],
                      "val_loss": parser["val_loss"], "lookahead": parser["tra_lookahead"],
                      "direction": parser["tra_direction"], "hypergradient": parser["hypergradient"],
                      "step_rule": parser["tra_step"]}  # fmt: skip
    assert copies == parser["tra_counterfactuals"] and f"{parser['val_batches']} val batches" in label
    assert catalogue == parser["tra_catalogue"] and f"{catalogue} catalogue" in label
    rows = {name: row for name, row in bench.OPTIONS.items() if "synthetic default" in name}
    assert sorted(kw["val_batches"] for _, kw, _ in rows.values()) == sorted([parser["val_batches"], 6])
    assert all(cls is TRAPolicyUpdater and k == copies for cls, _, k in rows.values())
    assert {bench.OPTION_CATALOGUES[name] for name in rows} == {catalogue}  # their policies are the bundle's
    # the arguments are the updater's own: it takes them as they are
    model = tiny_unet()
    policy = make_tra_policy("nnunet", 2, catalogue=catalogue)
    TRAPolicyUpdater(policy, model, [], torch.optim.SGD(model.parameters(), lr=0.01), **kwargs)
    # another bundle setting reaches the row
    edited = tmp_path / "train.yaml"
    edited.write_text((CONFIGS / "train.yaml").read_text().replace(
        f"val_batches: {parser['val_batches']} ", "val_batches: 3 ", 1))  # fmt: skip
    assert bench.synthetic_tra_settings(edited)[0]["val_batches"] == 3


def test_the_fixed_policy_learning_rates_are_the_bundles():
    bench = load_benchmark("bench_policy_learning")
    cfg = yaml.safe_load((CONFIGS / "train.yaml").read_text())
    assert (bench.TRA_LR, bench.TEA_LR) == (float(cfg["tra_lr"]), float(cfg["tea_lr"]))


def test_section_5_times_the_bundles_settings_in_both_catalogues_on_batches_of_each(bench):
    """The other catalogue's row differs from the default row in the catalogue alone, and every row's batches hold
    ops and counterfactual records drawn in its own catalogue (valid indices of its series)."""
    assert bench.OPTIONS[bench.OTHER_CATALOGUE_ROW] == bench.OPTIONS[bench.SYNTHETIC_ROW]
    # each other step rule's row: the bundle's settings, its catalogue, the rule alone changed
    assert {bench.SYNTHETIC_TRA["step_rule"], *bench.OTHER_STEP_ROWS} == set(POLICY_STEPS.names())
    for rule, row in bench.OTHER_STEP_ROWS.items():
        cls, kwargs, copies = bench.OPTIONS[row]
        assert kwargs == {**bench.SYNTHETIC_TRA, "step_rule": rule} and rule != bench.SYNTHETIC_TRA["step_rule"]
        assert bench.OPTION_CATALOGUES[row] == bench.SYNTHETIC_TRA_CATALOGUE
    catalogues = {bench.OPTION_CATALOGUES[bench.SYNTHETIC_ROW], bench.OPTION_CATALOGUES[bench.OTHER_CATALOGUE_ROW]}
    assert catalogues == {"spec", "split-signs"}
    batches = bench.make_batches(2, 4, 8, 0, None)
    for catalogue in catalogues:
        sizes = torch.tensor(make_tra_policy("nnunet", 2, catalogue=catalogue).series_sizes)
        for b in bench.with_counterfactuals(batches, 2, 0, catalogue):
            assert b["tra_ops"].shape == (4, len(sizes)) and bool((b["tra_ops"] < sizes).all())
            series, ops = b["tra_cf_ops"].unbind(-1)
            assert bool((ops < sizes[series]).all()) and b["image_cf"].shape == (4, 2, 1, 8, 8, 8)
    split_sizes = max(make_tra_policy("nnunet", 2, catalogue="split-signs").series_sizes)
    drawn = torch.cat([b["tra_cf_ops"][..., 1].flatten() for b in bench.with_counterfactuals(
        bench.make_batches(8, 8, 8, 1, None), 4, 1, "split-signs")])  # fmt: skip
    assert int(drawn.max()) > max(make_tra_policy("nnunet", 2).series_sizes) - 1  # beyond SPEC's indices
    assert int(drawn.max()) < split_sizes
