"""``policies.json``: the plain, named export of a run's TRA and TEA policies.

It is a view of the policies' state (the logits); :func:`load_policies` rebuilds the policies and
refuses a file whose series or op names do not match this version's catalogues.

Version 1 of the format (the only one so far)::

    {"format": "jcsaug-policies", "version": 1,
     "tra": {"num_groups": G, "groups": [{"group": g, "series": [{"series": name, "ops": [
         {"name": op, "probability": p, "logit": x}, ...]}, ...]}, ...]},
     "tea": {"ops": [{"id": i, "name": op, "probability": p, "logit": x}, ...]}}

``tra`` and ``tea`` are each optional. The logits are the state; the probabilities (``softmax`` of a series'
logits, of all ops for the TEA) are written for reading and checked on loading. To hand-make a policy, give the ops of
a series (or of the TEA) probabilities and no logits: they load as ``log(p)`` (finite, >= 0, summing to 1 within
``1e-3``; a 0 becomes ``1e-6``, the presets' floor, as logits are finite). A series whose stated probabilities differ
from the softmax of its logits by more than ``1e-3``, or where only some ops have logits, is refused.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path

import torch

from jcsaug.ops.tra import tra_catalogue_name
from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.policy.factory import make_tea_policy, make_tra_policy
from jcsaug.utils import atomic_write_text

FORMAT = "jcsaug-policies"
VERSION = 1
#: the versions :func:`load_policies` reads (a file without ``version`` is read as :data:`VERSION`: hand-written)
READABLE_VERSIONS = (1,)

# the entries of each object of the format: any other is refused (a misspelled "tra" would silently load no policy)
_TOP_KEYS = ("format", "version", "tra", "tea")
_TRA_KEYS = ("num_groups", "groups")
_GROUP_KEYS = ("group", "series")
_SERIES_KEYS = ("series", "ops")
_TEA_KEYS = ("ops",)
_OP_KEYS = ("name", "probability", "logit")
_TEA_OP_KEYS = ("id", *_OP_KEYS)


def policies_to_dict(tra: CategoricalPolicy | None = None, tea: CategoricalPolicy | None = None) -> dict:
    out: dict = {"format": FORMAT, "version": VERSION}
    if tra is not None:
        out["tra"] = tra.to_dict()
    if tea is not None:
        series = tea.to_dict()["groups"][0]["series"][0]["ops"]
        out["tea"] = {"ops": [{"id": i, **op} for i, op in enumerate(series)]}
    return out


def save_policies(path: str | Path, tra: CategoricalPolicy | None = None, tea: CategoricalPolicy | None = None) -> Path:
    atomic_write_text(path, json.dumps(policies_to_dict(tra, tea), indent=1))
    return Path(path)


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


def _read_json(path: Path) -> object:
    """The parsed file; every failure is a one-line ``ValueError`` naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(
            f"cannot read policy file {path}: not a UTF-8 text file (a policies.json is JSON text; is it a checkpoint?)"
        ) from None
    except OSError as err:
        raise ValueError(f"cannot read policy file {path}: {err.strerror or err}") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)  # NaN / Infinity are no logits
    except json.JSONDecodeError as err:
        raise ValueError(f"cannot read policy file {path}: not valid JSON ({err})") from None
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _entries(value: object, key: str, where: str, kind: type = list) -> object:
    """``value[key]`` checked to be a ``kind``."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} is a {type(value).__name__}, expected an object with {key!r}")
    if key not in value:
        raise ValueError(f"{where} has no {key!r} entry")
    entry = value[key]
    if not isinstance(entry, kind):
        raise ValueError(f"{where}: {key!r} is a {type(entry).__name__}, expected a {kind.__name__}")
    return entry


def _known_keys(value: object, known: tuple[str, ...], where: str) -> None:
    """Refuse entries of the object ``value`` that the format does not have (with the nearest known one)."""
    if not isinstance(value, dict):
        return  # its type is reported where it is read
    for key in value:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{where}: unknown entry {key!r}{hint}; the entries are {', '.join(map(repr, known))}")


def _check_position(value: dict, key: str, expected: int, where: str) -> None:
    """An index the file states (``group`` of a TRA group, ``id`` of a TEA op) must be the entry's position: the
    entries are read in order, so a file whose indices disagree would load into other groups or ops."""
    if key not in value:
        return  # optional: the position is the index
    index = value[key]
    if isinstance(index, bool) or not isinstance(index, int) or index != expected:
        raise ValueError(f"{where}: {key!r} is {index!r} but the entry is number {expected} (entries are in order)")


#: how far stated probabilities may be from the softmax of the logits, or their sum from 1 (the file writes float32s)
PROBABILITY_TOLERANCE = 1e-3
#: the probability a stated 0 becomes (logits are finite; other probabilities, however small, are kept): the floor of
#: ``CategoricalPolicy.set_probabilities``
PROBABILITY_FLOOR = 1e-6


def _number(op: dict, key: str, where: str) -> float | None:
    """``op[key]`` as a float, ``None`` where absent; anything but a JSON number is refused."""
    if key not in op:
        return None
    value = op[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: op {op['name']!r}: {key} {value!r} is not a number")
    try:
        return float(value)
    except OverflowError:  # an integer beyond float range
        return math.inf


def _from_probabilities(ops: list[dict], probs: list[float | None], where: str) -> list[float]:
    """Logits ``log(p)`` of a series given by its probabilities (a 0 becomes :data:`PROBABILITY_FLOOR`)."""
    values: list[float] = []
    for op, p in zip(ops, probs):
        if p is None:
            raise ValueError(f"{where}: op {op['name']!r} has neither a logit nor a probability")
        if not math.isfinite(p) or p < 0:
            bad = op["probability"]
            raise ValueError(f"{where}: op {op['name']!r}: probability {bad!r} is not a finite number >= 0")
        values.append(p)
    total = math.fsum(values)
    if abs(total - 1) > PROBABILITY_TOLERANCE:
        raise ValueError(f"{where}: the probabilities sum to {total:.6g}, not 1 (within {PROBABILITY_TOLERANCE:g})")
    floored = [p if p > 0 else PROBABILITY_FLOOR for p in values]  # only a 0 has no finite log
    norm = math.fsum(floored)
    return [math.log(p / norm) for p in floored]


def _check_agreement(ops: list[dict], logits: list[float], probs: list[float | None], where: str) -> None:
    """Every stated probability must be the softmax of the logits (within :data:`PROBABILITY_TOLERANCE`)."""
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    norm = math.fsum(e)
    for op, w, p in zip(ops, e, probs):
        if p is not None and not abs(w / norm - p) <= PROBABILITY_TOLERANCE:
            raise ValueError(
                f"{where}: op {op['name']!r}: probability {op['probability']!r} but softmax of the logits gives "
                f"{w / norm:.6g}: the stated probabilities disagree with the logits; delete the 'probability' "
                "entries to use the logits, or the 'logit' entries to use the probabilities"
            )


def _logits_of(ops: object, expected_names: list[str], where: str, ids: bool = False) -> list[float]:
    """The logits of a list of ops (TEA ops: ``ids``, each may state its ``id``): the stated logits, checked against
    any stated probabilities, or, where no op has a logit, ``log`` of the probabilities."""
    if not isinstance(ops, list) or not all(isinstance(op, dict) for op in ops):
        raise ValueError(
            f"{where}: ops must be a list of objects with 'name' and 'logit' (or 'probability'), got {ops!r:.80}"
        )
    for i, op in enumerate(ops):
        _known_keys(op, _TEA_OP_KEYS if ids else _OP_KEYS, f"{where}: op {i}")
    names = [op.get("name") for op in ops]
    if names != expected_names:
        raise ValueError(f"{where}: op names {names} do not match the catalogue {expected_names}")
    if ids:
        for i, op in enumerate(ops):
            _check_position(op, "id", i, f"{where}: op {op['name']!r}")
    stated = [_number(op, "logit", where) for op in ops]
    probs = [_number(op, "probability", where) for op in ops]
    if all(value is None for value in stated):
        return _from_probabilities(ops, probs, where)
    logits: list[float] = []
    for op, value in zip(ops, stated):
        if value is None:
            raise ValueError(
                f"{where}: op {op['name']!r} has no logit but other ops of the series have one: give every op a "
                "logit, or none (then the probabilities are used)"
            )
        if not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
            raise ValueError(f"{where}: op {op['name']!r}: logit {op['logit']!r} is not a finite float32 number")
        logits.append(value)
    _check_agreement(ops, logits, probs, where)
    return logits


def _tra_catalogue_in(groups: object) -> str:
    """The TRA catalogue whose op names the file's first group lists; ``spec`` when they name none (or are
    malformed), so that the checks below report what is wrong against SPEC's catalogue."""
    try:
        names = [[op["name"] for op in entry["ops"]] for entry in groups[0]["series"]]
        return tra_catalogue_name(names)
    except (KeyError, TypeError, IndexError, ValueError):
        return "spec"


def load_policies(path: str | Path) -> tuple[CategoricalPolicy | None, CategoricalPolicy | None]:
    """Rebuild ``(tra, tea)`` from a ``policies.json`` (either may be ``None`` if absent).

    Every problem (unreadable or non-JSON file, another format or a version this jcsaug does not read, missing,
    mistyped or unknown entries, a ``num_groups`` other than the groups listed, a group's ``group`` or a TEA op's
    ``id`` other than its position, series or op names of another catalogue, logits that are not finite float32
    numbers, probabilities that are no distribution or disagree with the logits, a series where only some ops have
    logits) is a one-line ``ValueError`` naming the file and the entry. ``version``, ``num_groups``, ``group`` and
    ``id`` may be left out (a hand-written file); where given they are checked.

    Example::

        >>> import tempfile
        >>> from jcsaug.policy import make_tea_policy, make_tra_policy
        >>> folder = Path(tempfile.mkdtemp())
        >>> path = save_policies(folder / "policies.json", make_tra_policy("deepmedic"), make_tea_policy())
        >>> tra, tea = load_policies(path)
        >>> tra.num_groups, tra.num_series, tea.series_sizes
        (2, 15, (84,))
    """
    path = Path(path)
    data = _read_json(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a jcsaug policies file (missing 'format': {FORMAT!r})")
    _known_keys(data, _TOP_KEYS, str(path))
    version = data.get("version", VERSION)
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise ValueError(
            f"{path}: 'version' is {version!r}; this jcsaug reads version(s) {', '.join(map(str, READABLE_VERSIONS))} "
            "of the policies format (a newer jcsaug wrote it?)"
        )
    tra = tea = None
    if "tra" in data:
        _known_keys(data["tra"], _TRA_KEYS, f"{path}: 'tra'")
        groups = _entries(data["tra"], "groups", f"{path}: 'tra'")
        if not groups:
            raise ValueError(f"{path}: the TRA policy has no class groups")
        stated = data["tra"].get("num_groups", len(groups))
        if isinstance(stated, bool) or stated != len(groups):
            raise ValueError(f"{path}: 'tra': 'num_groups' is {stated!r} but {len(groups)} groups are listed")
        tra = make_tra_policy("uniform", num_groups=len(groups), catalogue=_tra_catalogue_in(groups))
        rows = []
        for g, group in enumerate(groups):
            _known_keys(group, _GROUP_KEYS, f"{path}: TRA group {g}")
            series = _entries(group, "series", f"{path}: TRA group {g}")
            _check_position(group, "group", g, f"{path}: TRA group {g}")
            if len(series) != tra.num_series:
                raise ValueError(f"{path}: TRA policy has {len(series)} series, the catalogue has {tra.num_series}")
            row = []
            for s, entry in enumerate(series):
                _known_keys(entry, _SERIES_KEYS, f"{path}: TRA group {g}, series {s}")
                name = _entries(entry, "series", f"{path}: TRA group {g}, series {s}", str)
                if name != tra.series_names[s]:
                    raise ValueError(f"{path}: TRA series {s} is {name!r}, expected {tra.series_names[s]!r}")
                where = f"{path}: TRA group {g}, series {name!r}"
                row += _logits_of(_entries(entry, "ops", where), tra.op_names[s], where)
            rows.append(row)
        with torch.no_grad():
            tra.logits.copy_(torch.tensor(rows))
    if "tea" in data:
        tea = make_tea_policy("uniform")
        _known_keys(data["tea"], _TEA_KEYS, f"{path}: 'tea'")
        ops = _entries(data["tea"], "ops", f"{path}: 'tea'")
        logits = _logits_of(ops, tea.op_names[0], f"{path}: TEA policy", ids=True)
        with torch.no_grad():
            tea.logits.copy_(torch.tensor([logits]))
    return tra, tea
