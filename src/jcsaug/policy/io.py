"""``policies.json``: the plain, named export of a run's TRA and TEA policies.

It is a view of the policies' state (the logits); :func:`load_policies` rebuilds the policies and
refuses a file whose series or op names do not match this version's catalogues.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from jcsaug.policy.categorical import CategoricalPolicy
from jcsaug.policy.factory import make_tea_policy, make_tra_policy
from jcsaug.utils import atomic_write_text

FORMAT = "jcsaug-policies"
VERSION = 1


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


def _logits_of(ops: object, expected_names: list[str], where: str) -> list[float]:
    if not isinstance(ops, list) or not all(isinstance(op, dict) for op in ops):
        raise ValueError(f"{where}: ops must be a list of objects with 'name' and 'logit', got {ops!r:.80}")
    names = [op.get("name") for op in ops]
    if names != expected_names:
        raise ValueError(f"{where}: op names {names} do not match the catalogue {expected_names}")
    logits = []
    for op in ops:
        value = op.get("logit")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: op {op['name']!r}: logit {value!r} is not a number")
        if not math.isfinite(float(value)) or abs(float(value)) > _FLOAT32_MAX:
            raise ValueError(f"{where}: op {op['name']!r}: logit {value!r} is not a finite float32 number")
        logits.append(float(value))
    return logits


def load_policies(path: str | Path) -> tuple[CategoricalPolicy | None, CategoricalPolicy | None]:
    """Rebuild ``(tra, tea)`` from a ``policies.json`` (either may be ``None`` if absent).

    Every problem (unreadable or non-JSON file, another format, missing or mistyped entries, series or op names
    of another catalogue, logits that are not finite float32 numbers) is a one-line ``ValueError`` naming the file.

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
    tra = tea = None
    if "tra" in data:
        groups = _entries(data["tra"], "groups", f"{path}: 'tra'")
        if not groups:
            raise ValueError(f"{path}: the TRA policy has no class groups")
        tra = make_tra_policy("uniform", num_groups=len(groups))
        rows = []
        for g, group in enumerate(groups):
            series = _entries(group, "series", f"{path}: TRA group {g}")
            if len(series) != tra.num_series:
                raise ValueError(f"{path}: TRA policy has {len(series)} series, the catalogue has {tra.num_series}")
            row = []
            for s, entry in enumerate(series):
                name = _entries(entry, "series", f"{path}: TRA group {g}, series {s}", str)
                if name != tra.series_names[s]:
                    raise ValueError(f"{path}: TRA series {s} is {name!r}, expected {tra.series_names[s]!r}")
                ops = _entries(entry, "ops", f"{path}: series {name!r}")
                row += _logits_of(ops, tra.op_names[s], f"{path}: series {name!r}")
            rows.append(row)
        with torch.no_grad():
            tra.logits.copy_(torch.tensor(rows))
    if "tea" in data:
        tea = make_tea_policy("uniform")
        logits = _logits_of(_entries(data["tea"], "ops", f"{path}: 'tea'"), tea.op_names[0], f"{path}: TEA policy")
        with torch.no_grad():
            tea.logits.copy_(torch.tensor([logits]))
    return tra, tea
