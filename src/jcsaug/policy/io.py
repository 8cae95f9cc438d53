"""``policies.json``: the plain, named export of a run's TRA and TEA policies.

It is a view of the policies' state (the logits); :func:`load_policies` rebuilds the policies and
refuses a file whose series or op names do not match this version's catalogues.
"""

from __future__ import annotations

import json
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


def _logits_of(ops: list[dict], expected_names: list[str], where: str) -> list[float]:
    names = [op.get("name") for op in ops]
    if names != expected_names:
        raise ValueError(f"{where}: op names {names} do not match the catalogue {expected_names}")
    return [float(op["logit"]) for op in ops]


def load_policies(path: str | Path) -> tuple[CategoricalPolicy | None, CategoricalPolicy | None]:
    """Rebuild ``(tra, tea)`` from a ``policies.json`` (either may be ``None`` if absent).

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
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read policy file {path}: {err}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a jcsaug policies file (missing 'format': {FORMAT!r})")
    tra = tea = None
    try:
        if "tra" in data:
            groups = data["tra"]["groups"]
            tra = make_tra_policy("uniform", num_groups=len(groups))
            rows = []
            for g in groups:
                if len(g["series"]) != tra.num_series:
                    raise ValueError(f"{path}: TRA policy has {len(g['series'])} series, the catalogue has 15")
                row = []
                for s, entry in enumerate(g["series"]):
                    if entry["series"] != tra.series_names[s]:
                        raise ValueError(
                            f"{path}: TRA series {s} is {entry['series']!r}, expected {tra.series_names[s]!r}"
                        )
                    row += _logits_of(entry["ops"], tra.op_names[s], f"{path}: series {entry['series']!r}")
                rows.append(row)
            with torch.no_grad():
                tra.logits.copy_(torch.tensor(rows))
        if "tea" in data:
            tea = make_tea_policy("uniform")
            logits = _logits_of(data["tea"]["ops"], tea.op_names[0], f"{path}: TEA policy")
            with torch.no_grad():
                tea.logits.copy_(torch.tensor([logits]))
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path}: malformed policy file ({err!r})") from None
    return tra, tea
