"""Exact resume: stop after epoch 1 of 2 and resume == 2 epochs straight (CPU, seeded, DataLoader workers); the time
box, the per-epoch reseeding and the settings a resume must keep."""

from __future__ import annotations

import pytest
import torch
from ignite.engine import Engine
from monai.data import Dataset
from monai.inferers import SimpleInferer
from monai.transforms import Randomizable
from torch.utils.data import DataLoader

from helpers import run_bundle, small_dataset, synthetic_tra_policy
from jcsaug.engine import EpochReseeder, ResumeCheckpoint, StopAfterEpochs, TEAPolicyUpdater
from jcsaug.engine.base import ValidationStream
from jcsaug.engine.checkpoints import read_checkpoint, save_checkpoint_atomic, save_state_atomic
from jcsaug.policy import make_tea_policy


def _state(run_dir):
    return torch.load(run_dir / "resume.pt", map_location="cpu", weights_only=True)


def test_stop_and_resume_equals_straight_run(tmp_path):
    small_dataset(tmp_path)
    # exact resume is promised on the CPU (CUDA kernels such as index_put/scatter-add backward are not deterministic)
    common = dict(max_epochs=2, epoch_length=3, num_workers=2, tra_update_every=1, tea_update_every=1, device="cpu")
    straight = tmp_path / "straight"
    run_bundle(tmp_path, "train.yaml", output_dir=straight, **common)
    resumed = tmp_path / "resumed"
    run_bundle(tmp_path, "train.yaml", output_dir=resumed, stop_after_epochs=1, **common)
    assert _state(resumed)["trainer"]["iteration"] == 3  # stopped after epoch 1 (3 iterations)
    run_bundle(tmp_path, "train.yaml", output_dir=resumed, resume=True, **common)

    a, b = _state(straight), _state(resumed)
    initial = {"tra_updater": synthetic_tra_policy().logits, "tea_updater": make_tea_policy("nnunet").logits}
    assert a["trainer"]["iteration"] == b["trainer"]["iteration"] == 6
    for key, tensor in a["network"].items():
        assert torch.equal(tensor, b["network"][key]), key
    for updater in ("tra_updater", "tea_updater"):
        assert torch.equal(a[updater]["policy"]["logits"], b[updater]["policy"]["logits"]), updater
        assert a[updater]["updates"] == b[updater]["updates"] > 0
        assert a[updater]["skipped"] == b[updater]["skipped"]
        assert torch.equal(a[updater]["generator"], b[updater]["generator"])
        assert not torch.allclose(a[updater]["policy"]["logits"], initial[updater])
    assert (resumed / "policies.json").read_text() == (straight / "policies.json").read_text()


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    handler = ResumeCheckpoint(tmp_path, {}, resume=True)
    with pytest.raises(FileNotFoundError, match="resume.pt does not exist"):
        handler.load()
    (tmp_path / "resume.pt").write_bytes(b"\x00truncated")
    with pytest.raises(ValueError, match="cannot read checkpoint .*resume.pt"):
        handler.load()


# ----------------------------------------------------------------------------------------------- time box
@pytest.mark.parametrize("stop_first", [False, True], ids=["resume-first", "stop-first"])
def test_stop_after_epochs_counts_from_the_epoch_a_job_starts_at(tmp_path, stop_first):
    """A time-boxed job resumed with the same command runs N more epochs (not up to epoch N), whatever the order
    of the handlers (ResumeCheckpoint loads the saved epoch at STARTED too)."""

    def job(resume: bool) -> int:
        engine = Engine(lambda e, b: None)
        handlers = [ResumeCheckpoint(tmp_path, {}, resume=resume), StopAfterEpochs(2)]
        for handler in reversed(handlers) if stop_first else handlers:
            handler.attach(engine)
        engine.run(range(3), max_epochs=5)
        return engine.state.epoch

    assert job(resume=False) == 2
    assert job(resume=True) == 4  # two more
    assert job(resume=True) == 5  # the rest of the run


# ----------------------------------------------------------------------------------------------- reseeding
class _Draw(Randomizable):
    """A random transform: each item is the next draw of its random state."""

    def __call__(self, item):
        return int(self.R.randint(1 << 30))


class _Updater:
    """What EpochReseeder reads of a policy updater: its validation stream over its own loader."""

    def __init__(self, loader) -> None:
        self.val_stream = ValidationStream(loader)


def test_epoch_reseeder_reseeds_the_datasets_of_the_updaters_own_loaders():
    """The TEA's validation crops (its own loader's random transform) restart from the epoch's seed, as the listed
    datasets do: an interrupted run's process has drawn from them, a resumed one has not."""
    listed, own = Dataset([0] * 3, transform=_Draw()), Dataset([0] * 3, transform=_Draw())
    updaters = [_Updater(DataLoader(listed)), _Updater(DataLoader(own))]  # the first shares a listed dataset
    engine = Engine(lambda e, b: None)
    engine.state.epoch = 2

    def draws(datasets, updaters) -> tuple[list[int], list[int]]:
        EpochReseeder(7, datasets=datasets, updaters=updaters)(engine)
        return [listed[i] for i in range(3)], [own[i] for i in range(3)]

    first = draws([listed], updaters)
    assert draws([listed], updaters) == first  # after the draws of the first: the same again
    assert first[0] != first[1]  # a seed of its own
    assert draws([listed], [])[0] == first[0]  # a listed dataset keeps its seed, with or without updaters


# ----------------------------------------------------------------------------------------------- settings
def _tea(seed: int = 0, update_every: int = 1, **settings) -> TEAPolicyUpdater:
    return TEAPolicyUpdater(make_tea_policy("nnunet"), torch.nn.Conv3d(1, 2, 1), None, lr=0.01, seed=seed,
                            update_every=update_every, **settings)  # fmt: skip


def _resume(tmp_path, updater: TEAPolicyUpdater, settings: dict | None = None) -> None:
    engine = Engine(lambda e, b: None)
    ResumeCheckpoint(tmp_path, {"tea_updater": updater}, resume=True, settings=settings).attach(engine)
    engine.run(range(2), max_epochs=1)


@pytest.mark.filterwarnings("ignore:TEA update skipped")  # no validation data: every update skips
def test_resume_refuses_another_seed_or_update_interval(tmp_path):
    """The seed and the update interval (which sets the budget-derived policy lr) change the run: a resume with
    others is refused, naming each; a checkpoint saved before the settings were kept is not checked."""
    engine = Engine(lambda e, b: None)
    ResumeCheckpoint(tmp_path, {"tea_updater": _tea()}, settings={"seed": 0}).attach(engine)
    engine.run(range(2), max_epochs=1)
    _resume(tmp_path, _tea(), settings={"seed": 0})  # the same settings: accepted
    interval = (r"cannot resume .*resume\.pt with tea_updater\.update_every 2: that run was saved with "
                r"tea_updater\.update_every 1 \(after 2 iterations\)\. Resume continues a run exactly")  # fmt: skip
    with pytest.raises(ValueError, match=interval):
        _resume(tmp_path, _tea(update_every=2), settings={"seed": 0})
    with pytest.raises(ValueError, match=r"with --seed 1, tea_updater\.seed 1: that run was saved with seed 0, "
                       r"tea_updater\.seed 0 "):  # fmt: skip
        _resume(tmp_path, _tea(seed=1), settings={"seed": 1})

    state = read_checkpoint(tmp_path / "resume.pt")  # as saved before: no settings, no per-rank states
    for key in ("run_settings", "rank_states"):
        del state[key]
    del state["tea_updater"]["settings"]
    save_state_atomic(tmp_path / "resume.pt", state)
    updater = _tea(seed=1)
    _resume(tmp_path, updater, settings={"seed": 1})  # nothing to compare: loaded as before
    assert torch.equal(updater.generator.get_state(), state["tea_updater"]["generator"])


def test_resume_with_per_rank_states_refuses_another_number_of_processes(tmp_path):
    """Each rank's random stream is saved: a run saved by 2 processes cannot continue exactly in 1."""
    updater = _tea()
    trainer = {"iteration": 2, "epoch_length": 2, "max_epochs": 1}
    save_checkpoint_atomic(tmp_path / "resume.pt", {
        "tea_updater": updater, "trainer": trainer,
        "rank_states": {"world_size": 2, "states": {"tea_updater": {1: updater.state_dict()}}},
    })  # fmt: skip
    with pytest.raises(ValueError, match=r"with 1 process: that run was saved with 2 processes \(after 2 iterations"):
        _resume(tmp_path, _tea())


def test_each_rank_loads_its_own_updater_state(monkeypatch, tmp_path):
    """In-process view of the distributed resume (the gloo test in test_resume_distributed.py runs it for real): rank
    r > 0 takes its entry of ``rank_states``, rank 0 the objects' own; a file saved before per-rank states gives
    every rank rank 0's, with one warning (from rank 0)."""
    import ignite.distributed as idist

    first, second = _tea(seed=0), _tea(seed=5)  # two ranks' streams, drawn from (unlike a fresh updater's)
    for updater in (first, second):
        torch.randperm(10, generator=updater.generator)
    trainer = {"iteration": 2, "epoch_length": 2, "max_epochs": 1}
    per_rank = {"world_size": 2, "states": {"tea_updater": {1: second.state_dict()}}}
    save_checkpoint_atomic(tmp_path / "resume.pt", {"tea_updater": first, "trainer": trainer, "rank_states": per_rank})
    monkeypatch.setattr(idist, "get_world_size", lambda: 2)

    def resumed_generator(rank: int) -> torch.Tensor:
        monkeypatch.setattr(idist, "get_rank", lambda: rank)
        updater = _tea()  # seeded 0 + rank: the resumed state must replace it
        ResumeCheckpoint(tmp_path, {"tea_updater": updater, "trainer": Engine(lambda e, b: None)}, resume=True).load()
        return updater.generator.get_state()

    assert torch.equal(resumed_generator(0), first.generator.get_state())
    assert torch.equal(resumed_generator(1), second.generator.get_state())
    state = read_checkpoint(tmp_path / "resume.pt")
    del state["rank_states"]
    save_state_atomic(tmp_path / "resume.pt", state)
    with pytest.warns(UserWarning, match=r"holds no per-rank states .* the ranks draw the same ops"):
        assert torch.equal(resumed_generator(0), first.generator.get_state())
    assert torch.equal(resumed_generator(1), first.generator.get_state())


def test_a_resume_pt_from_before_the_tra_direction_was_saved_ran_with_v(tmp_path):
    """A TRA updater state saved without ``direction`` was made scoring against v (``validation``): resuming it
    with ``beyond-training`` (the synthetic bundle's default since) is refused, naming both; ``validation`` resumes."""
    from jcsaug.engine.resume import check_resume_matches

    state = {"tra_updater": {"settings": {"seed": 0, "lookahead": 16.0}}}
    check_resume_matches(state, tmp_path / "resume.pt", None, None,
                         updaters={"tra_updater": {"seed": 0, "direction": "validation"}})  # fmt: skip
    with pytest.raises(ValueError, match=r"with tra_updater\.direction beyond-training: that run was saved with "
                       r"tra_updater\.direction validation"):  # fmt: skip
        check_resume_matches(state, tmp_path / "resume.pt", None, None,
                             updaters={"tra_updater": {"seed": 0, "direction": "beyond-training"}})  # fmt: skip


def test_a_resume_pt_from_before_val_tea_was_a_share_saved_true_or_false(tmp_path):
    """The TRA's ``val_tea`` was saved as True / False before it became a share: the share 1 (or 0) resumes such a
    file, half is refused, naming both."""
    from jcsaug.engine.resume import check_resume_matches

    for saved, same in ((True, 1.0), (False, 0.0)):
        state = {"tra_updater": {"settings": {"seed": 0, "val_tea": saved}}}
        check_resume_matches(state, tmp_path / "resume.pt", None, None,
                             updaters={"tra_updater": {"seed": 0, "val_tea": same}})  # fmt: skip
        with pytest.raises(ValueError, match=rf"tra_updater\.val_tea 0\.5: that run was saved with .*val_tea {saved}"):
            check_resume_matches(state, tmp_path / "resume.pt", None, None,
                                 updaters={"tra_updater": {"seed": 0, "val_tea": 0.5}})  # fmt: skip


def test_a_resume_pt_from_before_the_tra_context_ran_without_one(tmp_path):
    """Run settings saved without ``tra_context`` were a run whose patches had no context: resuming it with the
    bundles' ``auto`` is refused, naming both; ``--tra_context 0`` resumes it. A run that saved its context keeps it."""
    from jcsaug.engine.resume import check_resume_matches

    old = {"run_settings": {"seed": 0}}
    check_resume_matches(old, tmp_path / "resume.pt", None, None, settings={"seed": 0, "tra_context": [0, 0, 0]})
    with pytest.raises(ValueError, match=r"with --tra_context \[18, 18, 18\]: that run was saved with tra_context "
                       r"\[0, 0, 0\]"):  # fmt: skip
        check_resume_matches(old, tmp_path / "resume.pt", None, None, settings={"seed": 0, "tra_context": [18] * 3})
    new = {"run_settings": {"seed": 0, "tra_context": [18, 18, 18]}}
    check_resume_matches(new, tmp_path / "resume.pt", None, None, settings={"seed": 0, "tra_context": [18] * 3})
    with pytest.raises(ValueError, match=r"--tra_context \[0, 0, 0\]"):
        check_resume_matches(new, tmp_path / "resume.pt", None, None, settings={"seed": 0, "tra_context": [0] * 3})


def test_a_resume_pt_from_before_the_roi_drew_centres_from_the_whole_volume(tmp_path):
    """Run settings saved without ``roi_threshold`` were a run without an ROI: resuming it with KiTS's -200 is
    refused, naming both; ``--roi_threshold None`` resumes it; a run that saved its threshold keeps it."""
    from jcsaug.engine.resume import check_resume_matches

    old = {"run_settings": {"seed": 0}}
    check_resume_matches(old, tmp_path / "resume.pt", None, None, settings={"seed": 0, "roi_threshold": None})
    with pytest.raises(ValueError, match=r"with --roi_threshold -200\.0: that run was saved with roi_threshold None"):
        check_resume_matches(old, tmp_path / "resume.pt", None, None, settings={"seed": 0, "roi_threshold": -200.0})
    new = {"run_settings": {"seed": 0, "roi_threshold": -200.0}}
    check_resume_matches(new, tmp_path / "resume.pt", None, None, settings={"seed": 0, "roi_threshold": -200.0})


def test_a_resume_pt_from_before_tea_volume_stats_read_each_patchs_own(tmp_path):
    """Run settings saved without ``tea_volume_stats`` were a run whose TEA read each patch's own statistics: resuming
    it with the dataset bundles' new default is refused, naming the setting; ``false`` resumes it."""
    from jcsaug.engine.resume import check_resume_matches

    old = {"run_settings": {"seed": 0}}
    check_resume_matches(old, tmp_path / "resume.pt", None, None, settings={"seed": 0, "tea_volume_stats": False})
    with pytest.raises(ValueError, match=r"--tea_volume_stats True: that run was saved with tea_volume_stats False"):
        check_resume_matches(old, tmp_path / "resume.pt", None, None, settings={"seed": 0, "tea_volume_stats": True})


@pytest.mark.filterwarnings("ignore:TEA update skipped")  # no validation data: every update skips
@pytest.mark.parametrize(
    ("saved", "asked", "named"),
    [
        ({}, {"mask_out_of_view": True}, r"tea_updater\.mask_out_of_view True: that run was saved with "
                                         r"tea_updater\.mask_out_of_view False"),
        ({"mask_out_of_view": True}, {}, r"tea_updater\.mask_out_of_view False: that run was saved with "
                                         r"tea_updater\.mask_out_of_view True"),
        ({}, {"background_patches": 1}, r"tea_updater\.background_patches 1: .* tea_updater\.background_patches 0"),
        ({"background_patches": 2}, {}, r"tea_updater\.background_patches 0: .* tea_updater\.background_patches 2"),
        ({}, {"op_score": "alone-hard"}, r"tea_updater\.op_score alone-hard: .* tea_updater\.op_score alone"),
        ({"estimator": "paired"}, {"estimator": "paired", "step_rule": "natural"},
         r"tea_updater\.step_rule natural: .* tea_updater\.step_rule adam"),
        ({"op_score": "alone-hard"}, {}, r"tea_updater\.op_score alone: .* tea_updater\.op_score alone-hard"),
        ({"inferer": SimpleInferer()}, {}, r"tea_updater\.inferer None: .* tea_updater\.inferer SimpleInferer"),
    ],
)  # fmt: skip
def test_a_tea_setting_switched_on_or_off_at_resume_is_refused(tmp_path, saved, asked, named):
    """The step rule and the TEA's scoring settings are saved whatever their value, so turning one on or off when
    resuming is refused, naming it (they were once saved only when not the default: the other direction
    went unchecked)."""

    engine = Engine(lambda e, b: None)
    ResumeCheckpoint(tmp_path, {"tea_updater": _tea(**saved)}).attach(engine)
    engine.run(range(2), max_epochs=1)
    _resume(tmp_path, _tea(**saved))  # the same settings: accepted
    with pytest.raises(ValueError, match=named):
        _resume(tmp_path, _tea(**asked))


@pytest.mark.filterwarnings("ignore:TEA update skipped")
def test_a_resume_pt_from_before_the_defaults_were_saved_ran_with_them(tmp_path):
    """A ``resume.pt`` whose TEA updater recorded its start, step rule and scoring settings only when not the default
    (until 2026-12-01) ran with the defaults where it holds none: those resume, any other value is refused."""
    from jcsaug.engine.resume import UPDATER_SETTINGS_BEFORE_SAVED

    engine = Engine(lambda e, b: None)
    ResumeCheckpoint(tmp_path, {"tea_updater": _tea()}).attach(engine)
    engine.run(range(2), max_epochs=1)
    state = read_checkpoint(tmp_path / "resume.pt")
    for key in ("start", "step_rule", "background_patches", "op_score", "mask_out_of_view", "inferer"):
        assert state["tea_updater"]["settings"][key] == UPDATER_SETTINGS_BEFORE_SAVED[key]  # the defaults, saved
        del state["tea_updater"]["settings"][key]
    save_state_atomic(tmp_path / "resume.pt", state)
    _resume(tmp_path, _tea())
    with pytest.raises(ValueError, match=r"tea_updater\.background_patches 1: .* tea_updater\.background_patches 0"):
        _resume(tmp_path, _tea(background_patches=1))
    with pytest.raises(ValueError, match=r"tea_updater\.inferer SimpleInferer: .* tea_updater\.inferer None"):
        _resume(tmp_path, _tea(inferer=SimpleInferer()))
