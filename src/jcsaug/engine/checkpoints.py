"""Finding, loading and saving a run's checkpoints safely.

* :func:`latest_checkpoint` finds the newest MONAI ``CheckpointSaver`` file of a run.
* :func:`load_checkpoint` / :class:`SafeCheckpointLoader` load one with ``weights_only=True`` and check
  every state against its object *before* loading any of them: a truncated, foreign or mismatched file
  raises a ``ValueError`` naming the file (and the key) and leaves every object untouched.
* :func:`save_checkpoint_atomic` / :class:`AtomicCheckpointSaver` write through a temporary file in the
  same folder + ``fsync`` + ``os.replace``: a crash mid-write never leaves a half-written file under the
  checkpoint's name. (MONAI's ``CheckpointSaver`` builds its ignite ``DiskSaver`` with ``atomic=False``,
  so it writes the final file in place.) Neither writes a state holding NaN/Inf (a diverged run): the
  previous, finite files stay (:func:`nonfinite_entries`). The saver removes the files beyond ``n_saved`` only
  once the new one is written, so a failed write keeps the last good checkpoint.
"""

from __future__ import annotations

import copy
import logging
import pickle
import re
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from monai.handlers import CheckpointSaver

from jcsaug.utils import atomic_write

_NUMBER = re.compile(r"=(\d+)\.pt$")

#: What ``torch.load`` raises for a truncated, corrupted or non-checkpoint file.
_READ_ERRORS = (
    RuntimeError,
    EOFError,
    OSError,
    ValueError,
    KeyError,
    AttributeError,
    TypeError,
    IndexError,
    UnicodeDecodeError,
    pickle.UnpicklingError,
    zipfile.BadZipFile,
)


def is_readable_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a complete ``torch.save`` zip archive (every member's CRC checked; not unpickled)."""
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.testzip() is None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return False


def latest_checkpoint(output_dir: str | Path, skip_unreadable: bool = False) -> Path:
    """The newest MONAI ``CheckpointSaver`` file in ``output_dir``: the final one if present, else the one
    with the highest epoch/iteration number.

    With ``skip_unreadable=True``, files that are not complete archives (e.g. cut off by a crash
    mid-write) are skipped with a warning, so the previous good checkpoint is returned.
    """
    output_dir = Path(output_dir)
    candidates = sorted(output_dir.glob("checkpoint_*.pt"))
    if skip_unreadable:
        bad = [p for p in candidates if not is_readable_checkpoint(p)]
        for p in bad:
            warnings.warn(f"skipping unreadable (truncated or corrupted) checkpoint {p}", stacklevel=2)
        candidates = [p for p in candidates if p not in bad]
    if not candidates:
        what = "readable checkpoint_*.pt" if skip_unreadable else "checkpoint_*.pt"
        raise FileNotFoundError(f"no {what} in {output_dir}: train first (configs/train.yaml)")
    final = [p for p in candidates if "final" in p.name]

    def number(p: Path) -> int:
        m = _NUMBER.search(p.name)
        return int(m.group(1)) if m else -1

    return max(final or candidates, key=lambda p: (number(p), p.stat().st_mtime))


# ----------------------------------------------------------------------------------------------- loading


_WEIGHTS_ONLY_REFUSAL = re.compile(
    r"(Unsupported global: GLOBAL \S+ was not an allowed global by default"
    r"|Trying to load unsupported GLOBAL [^\n]*"
    r"|Unsupported operand [^\n]*)",
    re.MULTILINE,
)


def _read_error_reason(err: BaseException) -> str:
    """One line saying why ``torch.load`` failed. For a weights-only refusal that is the refused global; torch's
    advice to re-run with ``weights_only=False`` (arbitrary code execution) is left out."""
    text = str(err).strip()
    if text.startswith("Weights only load failed"):
        found = _WEIGHTS_ONLY_REFUSAL.search(text)
        reason = found.group(1).rstrip(".") if found else "a pickled object that is not a tensor or plain value"
        return f"not a weights-only torch checkpoint (refused by the weights-only loader: {reason})"
    first = text.splitlines()[0] if text else ""
    cause = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return f"truncated, corrupted or not a weights-only torch checkpoint ({cause})"


def read_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict:
    """``torch.load(path, weights_only=True)`` as a dict, or a ``ValueError`` naming the file and the reason
    (for a file holding pickled code or objects: the global torch refused)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except _READ_ERRORS as err:
        raise ValueError(f"cannot read checkpoint {path}: {_read_error_reason(err)}") from None
    if not isinstance(state, Mapping):
        raise ValueError(f"checkpoint {path} holds a {type(state).__name__}, expected a dict of states")
    return dict(state)


_EXTRA_STATE = "_extra_state"  # torch.nn.Module's state-dict key suffix of get_extra_state()


def _check_module_state(path: Path, name: str, module: torch.nn.Module, state: Any, strict: bool) -> None:
    if not isinstance(state, Mapping):
        raise ValueError(f"checkpoint {path}: entry {name!r} is a {type(state).__name__}, expected a state dict")
    # a module's extra state (``get_extra_state``: not a tensor, e.g. DeepMedic's subsampling) is its own to check
    # and to default when a checkpoint from before it was saved lacks it (``_load_from_state_dict``)
    expected = {k: v for k, v in module.state_dict().items() if not k.endswith(_EXTRA_STATE)}
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected and not k.endswith(_EXTRA_STATE)]
    if strict and (missing or unexpected):
        raise ValueError(
            f"checkpoint {path}: state {name!r} does not fit the {type(module).__name__} "
            f"(missing keys {missing[:10]}, unexpected keys {unexpected[:10]})"
        )
    for k, ref in expected.items():
        if k not in state:
            continue
        value = state[k]
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"checkpoint {path}: {name}.{k} is a {type(value).__name__}, expected a tensor")
        if tuple(value.shape) != tuple(ref.shape):
            raise ValueError(
                f"checkpoint {path}: shape mismatch for {name}.{k}: checkpoint {tuple(value.shape)}, "
                f"model {tuple(ref.shape)}"
            )


def load_checkpoint(
    path: str | Path, objects: Mapping[str, Any], map_location: Any = "cpu", strict: bool = True
) -> dict:
    """Load the states of a checkpoint into ``objects`` (name -> object with ``load_state_dict``), all or none.

    The file is read with ``weights_only=True``. Before anything is loaded, every name of ``objects`` must
    be in the checkpoint and every module's tensors must have its parameters' names and shapes. The
    states are then loaded one by one; if an object still refuses its state, the objects already loaded
    are restored to their previous states. Every failure is a ``ValueError`` naming the file.

    Returns the checkpoint dict (e.g. to read extra entries).
    """
    path = Path(path)
    checkpoint = read_checkpoint(path, map_location)
    missing = [k for k in objects if k not in checkpoint]
    if missing:
        raise ValueError(
            f"checkpoint {path} is not a checkpoint of this run: missing entries {missing} "
            f"(entries present: {sorted(map(str, checkpoint))})"
        )
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            _check_module_state(path, name, obj, checkpoint[name], strict)
        elif not hasattr(obj, "load_state_dict"):
            raise TypeError(f"object {name!r} ({type(obj).__name__}) has no load_state_dict")

    snapshots: dict[str, Any] = {}
    try:
        for name, obj in objects.items():
            snapshots[name] = copy.deepcopy(obj.state_dict())
            if isinstance(obj, torch.nn.Module):
                obj.load_state_dict(checkpoint[name], strict=strict)
            else:
                obj.load_state_dict(checkpoint[name])
    except Exception as err:  # noqa: BLE001 - any refusal: roll back, then report
        for done, state in snapshots.items():
            try:
                objects[done].load_state_dict(state)
            except Exception:  # noqa: BLE001 - best effort: the original error is the one to report
                logging.getLogger(__name__).exception("could not restore %r after a failed load", done)
        raise ValueError(
            f"checkpoint {path}: state {name!r} does not fit the {type(objects[name]).__name__} "
            f"({type(err).__name__}: {err}); nothing was loaded"
        ) from err
    return checkpoint


class SafeCheckpointLoader:
    """Ignite handler: :func:`load_checkpoint` at ``Events.STARTED`` (a drop-in for MONAI's
    ``CheckpointLoader``: same ``load_path`` / ``load_dict`` / ``map_location`` / ``strict`` arguments).

    Unlike MONAI's loader it refuses a truncated or foreign file with a ``ValueError`` naming it and
    never leaves the objects half-loaded. A bare state dict for a one-object ``load_dict`` is not
    accepted: the checkpoint must hold the object's name.
    """

    def __init__(
        self,
        load_path: str | Path,
        load_dict: Mapping[str, Any],
        name: str | None = None,
        map_location: Any = "cpu",
        strict: bool = True,
    ) -> None:
        if not load_dict:
            raise ValueError("SafeCheckpointLoader needs at least one object to load")
        self.load_path = Path(load_path)
        self.load_dict = dict(load_dict)
        self.map_location = map_location
        self.strict = strict
        self.logger = logging.getLogger(name or __name__)

    def attach(self, engine) -> None:
        from ignite.engine import Events

        engine.add_event_handler(Events.STARTED, self)

    def __call__(self, engine) -> None:
        prior_max_epochs = engine.state.max_epochs
        load_checkpoint(self.load_path, self.load_dict, self.map_location, self.strict)
        if prior_max_epochs is not None and engine.state.epoch > prior_max_epochs:
            raise ValueError(
                f"epoch count ({engine.state.epoch}) in checkpoint {self.load_path} is larger than the engine's "
                f"max_epochs ({prior_max_epochs})"
            )
        engine.state.max_epochs = prior_max_epochs
        self.logger.info(f"Restored all variables from {self.load_path}")


# ------------------------------------------------------------------------------------------------ saving


def nonfinite_entries(objects: Mapping[str, Any], limit: int = 5) -> list[str]:
    """Names (``"network.conv.weight"``) of up to ``limit`` floating-point tensors holding NaN/Inf in the states of
    ``objects`` (name -> object with ``state_dict``, or a plain value), nested dicts and lists included."""
    found: list[str] = []

    def visit(name: str, value: Any) -> None:
        if len(found) >= limit:
            return
        if isinstance(value, torch.Tensor):
            if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
                found.append(name)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                visit(f"{name}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(f"{name}.{i}", v)

    for key, obj in objects.items():
        visit(str(key), obj.state_dict() if hasattr(obj, "state_dict") else obj)
    return found


def _refuse_nonfinite(path: str | Path, objects: Mapping[str, Any]) -> None:
    bad = nonfinite_entries(objects)
    if bad:
        from jcsaug.engine.divergence import TrainingDiverged

        raise TrainingDiverged(
            f"not saving {path}: the state holds NaN/Inf values ({', '.join(bad)}): the run diverged; the previous "
            "file is kept"
        )


def save_state_atomic(path: str | Path, state: Any) -> Path:
    """``torch.save(state, path)`` through :func:`jcsaug.utils.atomic_write` (temporary file in the same folder,
    ``fsync``, ``os.replace``): the file under ``path`` is either the previous one or the complete new one."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(state, f)

    return atomic_write(path, write)


def save_checkpoint_atomic(path: str | Path, objects: Mapping[str, Any], check_finite: bool = True) -> Path:
    """Save ``{name: obj.state_dict()}`` (plain values as they are) atomically, see :func:`save_state_atomic`.

    With ``check_finite`` a state holding NaN/Inf is refused (``TrainingDiverged``) and the file is not touched.
    """
    if check_finite:
        _refuse_nonfinite(path, objects)
    state = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in objects.items()}
    return save_state_atomic(path, state)


class AtomicCheckpointSaver(CheckpointSaver):
    """MONAI's ``CheckpointSaver`` (same arguments) whose files are written atomically by
    :func:`save_state_atomic` (MONAI's own uses ``DiskSaver(atomic=False)`` and writes in place), never
    from a non-finite state, and whose old files go only once the new one is written: ignite removes the oldest
    of ``n_saved`` files *before* writing the new one, so a failed write (disk full, a kill during the save)
    would leave no checkpoint at all; here the removal waits for the next successful write. A non-finite state at
    an epoch end or at the end of training raises ``TrainingDiverged`` (the run fails, the previous files stay);
    after an exception the final checkpoint is skipped with an error log.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for checkpoint in (self._final_checkpoint, self._key_metric_checkpoint, self._interval_checkpoint):
            if checkpoint is None:
                continue
            handler = checkpoint.save_handler
            if not hasattr(handler, "_save_func") or not hasattr(handler, "dirname"):
                raise TypeError(f"unexpected ignite save handler {type(handler).__name__}: cannot make it atomic")
            _save_before_removing(handler)

    def completed(self, engine: Any) -> None:
        _refuse_nonfinite(f"the final checkpoint in {self.save_dir}", self.save_dict)
        super().completed(engine)

    def interval_completed(self, engine: Any) -> None:
        _refuse_nonfinite(f"the checkpoint of epoch {engine.state.epoch} in {self.save_dir}", self.save_dict)
        super().interval_completed(engine)

    def metrics_completed(self, engine: Any) -> None:
        _refuse_nonfinite(f"the key-metric checkpoint in {self.save_dir}", self.save_dict)
        super().metrics_completed(engine)

    def exception_raised(self, engine: Any, e: Exception) -> None:
        bad = nonfinite_entries(self.save_dict)
        if bad:
            logging.getLogger(__name__).error(
                "not saving a final checkpoint after %s: the state holds NaN/Inf values (%s)", type(e).__name__,
                ", ".join(bad),
            )  # fmt: skip
            raise e
        super().exception_raised(engine, e)


def _save_before_removing(handler: Any) -> None:
    """Make an ignite ``DiskSaver`` write atomically and remove the files ignite retires (``remove``, called before
    the write) only after the next write succeeded; the newly written file itself is never removed (MONAI's
    fixed-name final checkpoint is retired and rewritten under the same name)."""
    retired: list[Path] = []

    def remove(filename: str) -> None:
        if idist.get_rank() == handler.save_on_rank:  # the rank that writes (DiskSaver.remove's own check)
            retired.append(Path(handler.dirname) / (getattr(handler, "filename", None) or filename))

    def save(checkpoint: Mapping, path: Path, func: Any = None) -> None:
        save_state_atomic(path, checkpoint)  # raises on failure: the retired files stay
        while retired:
            old = retired.pop(0)
            if old != Path(path):
                old.unlink(missing_ok=True)  # missing: a retired file whose own write had failed

    handler.remove = remove
    handler._save_func = save
