"""CategoricalPolicy, presets and factories."""

import json
import multiprocessing as mp
import re

import numpy as np
import pytest
import torch
from monai.utils import set_determinism
from scipy import stats

from jcsaug.ops.tra import TRA_SERIES
from jcsaug.policy import (
    NOT_APPLIED,
    TRA_PRESETS,
    CategoricalPolicy,
    make_tea_policy,
    make_tra_policy,
    series_probs,
)
from jcsaug.policy.io import load_policies, save_policies
from jcsaug.policy.presets import NNUNET_Q, TEA_FLIP_IDS

# the mutation run's test set (tests/README.md): all but the worker-process test at the end (slow, not maths)
method = pytest.mark.method


@method
def test_tra_policy_shape_and_nnunet_init():
    policy = make_tra_policy("nnunet", num_groups=2)
    assert policy.logits.shape == (2, 62)
    assert policy.num_series == 15
    probs = policy.probabilities()
    for s, series in enumerate(TRA_SERIES):
        q = NNUNET_Q[series.name]
        expected = np.r_[1 - q, np.full(series.size - 1, q / (series.size - 1))]
        np.testing.assert_allclose(probs[s][0].numpy(), expected, rtol=1e-5)
        np.testing.assert_allclose(probs[s][1].numpy(), expected, rtol=1e-5)


@method
@pytest.mark.parametrize("name", sorted(TRA_PRESETS))
def test_every_preset_is_a_distribution(name):
    for p, series in zip(series_probs(name, TRA_SERIES), TRA_SERIES):
        assert p.shape == (series.size,)
        assert np.isclose(p.sum(), 1.0)


@method
def test_randaugment_puts_mass_on_one_level():
    s_probs = series_probs("randaugment-s", TRA_SERIES)
    l_probs = series_probs("randaugment-l", TRA_SERIES)
    scale = [i for i, s in enumerate(TRA_SERIES) if s.name == "scale"][0]
    np.testing.assert_allclose(s_probs[scale], [0.8, 0.2, 0, 0, 0, 0])
    np.testing.assert_allclose(l_probs[scale], [0.8, 0, 0, 0, 0, 0.2])
    blur = [i for i, s in enumerate(TRA_SERIES) if s.name == "blur_sharpen"][0]
    # blur [.4,.6) and sharpen [.8,1) are level 0
    np.testing.assert_allclose(s_probs[blur], [0.8, 0.1, 0, 0, 0.1, 0, 0])


@method
def test_user_mapping_preset_and_errors():
    p = series_probs({"gamma": 0.4, "noise": [0.5, 0.5, 0, 0]}, TRA_SERIES)
    names = [s.name for s in TRA_SERIES]
    np.testing.assert_allclose(p[names.index("gamma")], [0.6, 0.4 / 3, 0.4 / 3, 0.4 / 3])
    np.testing.assert_allclose(p[names.index("noise")], [0.5, 0.5, 0, 0])
    np.testing.assert_allclose(p[names.index("scale")], [1, 0, 0, 0, 0, 0])  # left out: never applied
    with pytest.raises(KeyError, match="unknown TRA preset 'nnunett'"):
        make_tra_policy("nnunett")
    with pytest.raises(KeyError, match="gama"):
        series_probs({"gama": 0.1}, TRA_SERIES)
    with pytest.raises(ValueError, match="noise"):
        series_probs({"noise": [0.5, 0.5]}, TRA_SERIES)


@method
def test_tea_policy_init():
    policy = make_tea_policy("nnunet")
    assert policy.logits.shape == (1, 84)
    p = policy.probabilities()[0][0].numpy()
    np.testing.assert_allclose(p[list(TEA_FLIP_IDS)], 0.1, rtol=1e-5)
    others = np.delete(p, list(TEA_FLIP_IDS))
    np.testing.assert_allclose(others, 0.2 / 76, rtol=1e-5)
    with pytest.raises(KeyError, match="unknown TEA preset"):
        make_tea_policy("nope")


@method
def test_sample_ops_frequencies_match_probabilities():
    policy = CategoricalPolicy([4, 2], num_groups=2, init_probs=[[0.1, 0.2, 0.3, 0.4], [[0.9, 0.1], [0.2, 0.8]]])
    rng = np.random.RandomState(0)
    n = 8000
    draws = np.stack([policy.sample_ops(1, rng) for _ in range(n)])
    assert stats.chisquare(np.bincount(draws[:, 0], minlength=4), np.array([0.1, 0.2, 0.3, 0.4]) * n).pvalue > 1e-3
    assert stats.chisquare(np.bincount(draws[:, 1], minlength=2), np.array([0.2, 0.8]) * n).pvalue > 1e-3


@method
def test_same_seed_same_ops():
    policy = make_tra_policy("uniform")

    def draw():
        set_determinism(seed=7)
        rng = np.random.RandomState(np.random.randint(0, 2**31 - 1))
        return np.stack([policy.sample_ops(i % 2, rng) for i in range(20)])

    np.testing.assert_array_equal(draw(), draw())
    set_determinism(None)


@method
def test_weights_are_one_and_reach_only_the_sample_group():
    policy = make_tra_policy("nnunet", num_groups=3)
    rng = np.random.RandomState(0)
    choices = torch.as_tensor(np.stack([policy.sample_ops(0, rng), policy.sample_ops(0, rng)]))
    choices[1, 4] = NOT_APPLIED
    w = policy.weights(choices, torch.tensor([0, 2]), torch.Generator().manual_seed(0))
    assert torch.equal(w.detach(), torch.ones(2))
    w[0].backward()
    assert policy.logits.grad[0].abs().sum() > 0
    assert policy.logits.grad[1:].abs().sum() == 0


@method
def test_not_applied_series_has_no_gradient():
    policy = CategoricalPolicy([3, 3])
    w = policy.series_weights(torch.tensor([[NOT_APPLIED, 1]]))
    w.sum().backward()
    assert policy.logits.grad[0, :3].abs().sum() == 0
    assert policy.logits.grad[0, 3:].abs().sum() > 0


@method
def test_bad_shapes_and_groups():
    policy = make_tra_policy("nnunet", num_groups=2)
    with pytest.raises(ValueError, match=r"choices must be \[batch, 15\]"):
        policy.weights(torch.zeros(2, 14, dtype=torch.long), torch.zeros(2))
    with pytest.raises(ValueError, match="out of range"):
        policy.weights(torch.zeros(2, 15, dtype=torch.long), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="class group 5 out of range"):
        policy.sample_ops(5, np.random.RandomState(0))
    with pytest.raises(ValueError, match=r"logits of shape \(1, 62\) do not match"):
        policy.load_state_dict({"logits": torch.zeros(1, 62)})
    with pytest.raises(ValueError, match="expected probabilities for 2 series"):
        CategoricalPolicy([2, 3], init_probs=[[0.5, 0.5]])
    with pytest.raises(ValueError, match="series_sizes"):
        CategoricalPolicy([])


@method
def test_state_dict_is_tensors_only_and_round_trips(tmp_path):
    policy = make_tra_policy("deepmedic")
    with torch.no_grad():
        policy.logits.add_(torch.randn_like(policy.logits))
    path = tmp_path / "p.pt"
    torch.save(policy.state_dict(), path)
    other = make_tra_policy("nnunet")
    other.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(other.logits, policy.logits)
    assert other.logits.is_shared()


def _saved_policies(tmp_path):
    torch.manual_seed(0)
    tra, tea = make_tra_policy("nnunet", num_groups=3), make_tea_policy("nnunet")
    with torch.no_grad():
        tra.logits.add_(torch.randn_like(tra.logits))
        tea.logits.add_(torch.randn_like(tea.logits))
    return tra, tea, save_policies(tmp_path / "policies.json", tra, tea)


def test_policies_json_loads_as_written_and_without_its_optional_indices(tmp_path):
    """What jcsaug writes loads exactly; a hand-written file may leave out version, num_groups, group and id."""
    tra, tea, path = _saved_policies(tmp_path)
    loaded = load_policies(path)
    assert torch.equal(loaded[0].logits, tra.logits) and torch.equal(loaded[1].logits, tea.logits)
    doc = json.loads(path.read_text())
    del doc["version"], doc["tra"]["num_groups"]
    for group in doc["tra"]["groups"]:
        del group["group"]
    for op in doc["tea"]["ops"]:
        del op["id"]
    path.write_text(json.dumps(doc))
    loaded = load_policies(path)
    assert torch.equal(loaded[0].logits, tra.logits) and torch.equal(loaded[1].logits, tea.logits)


def _swap_groups(doc):
    groups = doc["tra"]["groups"]
    groups[0]["group"], groups[2]["group"] = 2, 0  # indices swapped: the rows would load into the wrong class groups


def _assert_edit_refused(tmp_path, edit, expected):
    """A saved policies.json edited by ``edit`` is refused with a one-line error naming the file, then ``expected``."""
    path = _saved_policies(tmp_path)[2]
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {expected}") as err:
        load_policies(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d.update(version=99), r"'version' is 99; this jcsaug reads version\(s\) 1 of the policies format"),
        (lambda d: d.update(version="1"), r"'version' is '1'; this jcsaug reads"),
        (lambda d: d.update(version=True), r"'version' is True; this jcsaug reads"),
        (lambda d: d["tra"].update(num_groups=5), r"'tra': 'num_groups' is 5 but 3 groups are listed"),
        (_swap_groups, r"TRA group 0: 'group' is 2 but the entry is number 0 \(entries are in order\)"),
        (lambda d: [op.update(id=83 - i) for i, op in enumerate(d["tea"]["ops"])],
         r"TEA policy: op 'identity': 'id' is 83 but the entry is number 0"),
        (lambda d: d.update({"tra ": d.pop("tra")}), r"unknown entry 'tra ' \(did you mean 'tra'\?\); the entries are"),
        (lambda d: d["tra"].update(num_group=3), r"'tra': unknown entry 'num_group' \(did you mean 'num_groups'\?\)"),
        (lambda d: d["tea"]["ops"][4].update(logits=1.0), r"TEA policy: op 4: unknown entry 'logits' \(did you mean"),
    ],
)  # fmt: skip
def test_malformed_policies_json_is_refused_naming_the_file_and_the_entry(tmp_path, edit, expected):
    """A wrong version, a num_groups other than the groups listed, group/op indices out of order and unknown
    (misspelled) entries were loaded silently, some into the wrong class group or as no policy at all."""
    _assert_edit_refused(tmp_path, edit, expected)


def _tra_ops(doc, group, series):
    return doc["tra"]["groups"][group]["series"][series]["ops"]


def _series_probabilities(policy, group, series):
    return policy.probabilities()[series][group].double()


def test_edited_probabilities_without_logits_make_the_policy(tmp_path):
    """A series (or the TEA policy) whose ops give probabilities and no logits loads as log(p); a zero becomes the
    presets' floor 1e-6 (logits are finite); other series keep their logits."""
    tra, tea, path = _saved_policies(tmp_path)
    doc = json.loads(path.read_text())
    ops = _tra_ops(doc, 1, 3)  # rotate_longitudinal of group 1
    wanted = [0.0] * len(ops)
    wanted[0], wanted[1], wanted[-1] = 0.7, 1e-9, 0.3 - 1e-9  # a tiny probability is kept, not floored
    for op, p in zip(ops, wanted):
        op["probability"] = p
        del op["logit"]
    tea_wanted = np.zeros(len(doc["tea"]["ops"]))
    tea_wanted[[0, 5]] = 0.5
    for op, p in zip(doc["tea"]["ops"], tea_wanted):
        op["probability"] = float(p)
        del op["logit"]
    path.write_text(json.dumps(doc))
    new_tra, new_tea = load_policies(path)
    np.testing.assert_allclose(_series_probabilities(new_tra, 1, 3).numpy(), wanted, atol=1e-5)
    assert _series_probabilities(new_tra, 1, 3)[1] == pytest.approx(1e-9, rel=1e-3)
    assert torch.isfinite(new_tra.logits).all() and torch.isfinite(new_tea.logits).all()
    np.testing.assert_allclose(new_tea.probabilities()[0][0].double().numpy(), tea_wanted, atol=1e-4)
    untouched = torch.ones_like(tra.logits, dtype=torch.bool)
    untouched[1, tra.series_slice(3)] = False
    assert torch.equal(new_tra.logits[untouched], tra.logits[untouched])
    # what it writes back loads unchanged (round trip)
    again = load_policies(save_policies(tmp_path / "again.json", new_tra, new_tea))
    assert torch.equal(again[0].logits, new_tra.logits) and torch.equal(again[1].logits, new_tea.logits)


def _set_probability(group, series, op, value):
    return lambda d: _tra_ops(d, group, series)[op].update(probability=value)


def _probabilities_only(group, series, values):
    def edit(doc):
        for op, p in zip(_tra_ops(doc, group, series), values):
            op.pop("logit")
            op["probability"] = p

    return edit


def _drop_logit(group, series, op):
    return lambda d: _tra_ops(d, group, series)[op].pop("logit")


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (_set_probability(2, 0, 1, 0.9), r"TRA group 2, series 'scale': op '\S+': probability 0\.9 but softmax of the "
         r"logits gives 0\.\d+: the stated probabilities disagree with the logits; delete the 'probability' entries "
         r"to use the logits, or the 'logit' entries to use the probabilities"),
        (lambda d: d["tea"]["ops"][3].update(probability=0.5), r"TEA policy: op '\S+': probability 0\.5 but softmax"),
        (_set_probability(0, 1, 0, "0.1"), r"TRA group 0, series '\S+': op '\S+': probability '0\.1' is not a number"),
        (_probabilities_only(1, 3, [0.5, 0.2, 0.2, 0, 0]),
         r"TRA group 1, series 'rotate_longitudinal': the probabilities sum to 0\.9, not 1"),
        (_probabilities_only(1, 3, [1.2, -0.2, 0, 0, 0]), r"TRA group 1, series 'rotate_longitudinal': op '\S+': "
         r"probability -0\.2 is not a finite number >= 0"),
        (_drop_logit(0, 2, 1), r"TRA group 0, series '\S+': op '\S+' has no logit but other ops of the series have "
         r"one: give every op a logit, or none"),
        (lambda d: [op.pop(k) for op in _tra_ops(d, 0, 2) for k in ("logit", "probability")],
         r"TRA group 0, series '\S+': op '\S+' has neither a logit nor a probability"),
    ],
)  # fmt: skip
def test_probabilities_that_disagree_with_the_logits_or_are_no_distribution_are_refused(tmp_path, edit, expected):
    """The probabilities were ignored: an edited one silently loaded the old policy."""
    _assert_edit_refused(tmp_path, edit, expected)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_update_in_main_process_is_seen_by_workers(method):
    policy = CategoricalPolicy([3])
    assert policy.logits.is_shared()
    ctx = mp.get_context(method)
    to_child, to_parent = ctx.Queue(), ctx.Queue()
    # the policy reaches the worker first (as a Dataset's transform does), then the main process updates it
    proc = ctx.Process(target=_reader, args=(policy, to_child, to_parent))
    proc.start()
    assert to_parent.get(timeout=120) == "ready"
    opt = torch.optim.SGD(policy.parameters(), lr=10.0)
    (-policy.logits[0, 2]).backward()
    opt.step()
    to_child.put("updated")
    seen = to_parent.get(timeout=120)
    proc.join(timeout=60)
    np.testing.assert_allclose(seen, policy.probabilities()[0][0].numpy(), rtol=1e-6)
    assert seen[2] > 0.9


def _reader(policy, to_child, to_parent):
    to_parent.put("ready")
    assert to_child.get(timeout=120) == "updated"
    to_parent.put(policy.probabilities()[0][0].tolist())
