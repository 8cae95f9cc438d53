"""Figures of learned policies and of the op catalogues (matplotlib, optional ``plot`` extra).

* :func:`plot_policy`: the TRA policy per class group (a stacked bar per series) and the TEA policy's
  most probable ops;
* :func:`plot_policy_history`: op probabilities over training, from a run's ``policy_history.jsonl``;
* :func:`ops_gallery`: the 84 TEA ops and a few TRA draws applied to a NIfTI volume (middle slice).

matplotlib is imported on use; figures are drawn on an Agg canvas without touching pyplot's global
state, so plotting works headless and inside a training process. Images are saved at exactly
``figsize * dpi`` pixels (no tight bounding box).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from jcsaug.policy.categorical import CategoricalPolicy

PolicyPair = tuple["CategoricalPolicy | None", "CategoricalPolicy | None"]

PLOT_INSTALL_HINT = 'matplotlib is needed for plots: pip install "jcsaug[plot]"'

#: One sequential colour map per TRA series (identity lightest, larger magnitudes darker).
_SERIES_CMAPS = (
    "Greys", "Blues", "Purples", "BuPu", "Greens", "YlGn", "BuGn", "Oranges",
    "YlOrBr", "Reds", "PuRd", "RdPu", "OrRd", "PuBu", "GnBu",
)  # fmt: skip

#: Short names of the TRA series for titles (gallery draws).
_SERIES_SHORT = {
    "scale": "sc",
    "rotate_frontal": "rotF",
    "rotate_sagittal": "rotS",
    "rotate_longitudinal": "rotL",
    "mirror_sagittal": "mirS",
    "mirror_frontal": "mirF",
    "mirror_axial": "mirA",
    "gamma": "gam",
    "inverted_gamma": "igam",
    "intensity_shift": "shift",
    "intensity_scale": "iscale",
    "contrast": "contr",
    "blur_sharpen": "",
    "noise": "noise",
    "low_resolution": "lowres",
}
_KIND_SHORT = {"blur": "blur", "sharpen": "shrp"}


# ----------------------------------------------------------------------------- matplotlib
def _matplotlib() -> Any:
    """The ``matplotlib`` module, or an ImportError with the install hint."""
    try:
        import matplotlib  # noqa: PLC0415
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401, PLC0415
    except ImportError as err:
        raise ImportError(PLOT_INSTALL_HINT) from err
    return matplotlib


def _new_figure(figsize: tuple[float, float], dpi: int, layout: str | None = "constrained") -> Any:
    """A figure on its own Agg canvas (no pyplot, no global backend switch)."""
    _matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=figsize, dpi=dpi, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, out_png: str | Path) -> Path:
    from jcsaug.utils import atomic_write  # noqa: PLC0415

    return atomic_write(
        out_png, lambda tmp: fig.savefig(tmp, dpi=fig.dpi, format="png", facecolor="white"), suffix=".png"
    )


# ----------------------------------------------------------------------------- inputs
def _resolve_policies(policies: str | Path | Sequence[Any]) -> PolicyPair:
    """``(tra, tea)`` from a ``policies.json`` path or a pair of policies (either may be ``None``)."""
    if isinstance(policies, (str, Path)):
        from jcsaug.policy.io import load_policies  # noqa: PLC0415

        path = Path(policies)
        if not path.is_file():
            raise FileNotFoundError(f"no policy file {path}")
        tra, tea = load_policies(path)
    else:
        tra, tea = policies
    if tra is None and tea is None:
        raise ValueError("no TRA or TEA policy to plot")
    return tra, tea


def _segment_label(series: str, op_name: str) -> str:
    """Short label of a TRA op inside its series' bar: ``id``, a magnitude level, ``90°``, ``flip``."""
    if op_name == "identity":
        return "id"
    from jcsaug.ops.tra import TRA_CATALOGUES  # noqa: PLC0415

    for _, catalogue in TRA_CATALOGUES.items():
        for s in catalogue:
            if s.name == series and op_name in s.op_names:
                op = s.ops[s.index_of(op_name) - 1]
                sign = op.fixed_sign
                if op.kind == "rot90":
                    return "90°" + sign
                if op.kind == "flip":
                    return "flip"
                prefix = _KIND_SHORT.get(op.kind, "")[:1]
                return f"{prefix}{op.level + 1}{sign}" if op.level is not None else op_name
    return op_name


def tra_short_name(series_index: int, op_index: int, catalogue: str = "spec") -> str:
    """Short name of TRA op ``op_index`` of series ``series_index`` of a TRA catalogue, e.g. ``sc2``, ``rotF90``,
    ``mirS`` (``split-signs``: the sign after it, ``sc2-``)."""
    from jcsaug.ops.tra import tra_catalogue  # noqa: PLC0415

    s = tra_catalogue(catalogue)[series_index]
    op = s.op(int(op_index))
    if op is None:
        return "id"
    base = _SERIES_SHORT.get(s.name, s.name) or _KIND_SHORT.get(op.kind, op.kind)
    sign = op.fixed_sign
    if op.kind == "rot90":
        return f"{base}90{sign}"
    if op.kind == "flip" or op.level is None:
        return base
    return f"{base}{op.level + 1}{sign}"


# ----------------------------------------------------------------------------- policy figure
def _draw_tra_group(ax: Any, tra: CategoricalPolicy, probs: list[np.ndarray], group: int, show_names: bool) -> None:
    import matplotlib  # noqa: PLC0415

    n_series = tra.num_series
    for s in range(n_series):
        y = n_series - 1 - s  # first series on top
        cmap = matplotlib.colormaps[_SERIES_CMAPS[s % len(_SERIES_CMAPS)]]
        p = probs[s][group]
        n = len(p)
        shades = [0.12 + 0.78 * (j / (n - 1) if n > 1 else 0.0) for j in range(n)]
        lefts = np.concatenate([[0.0], np.cumsum(p)[:-1]])
        # one call per series (a call per op took a fifth of the figure's time)
        ax.barh([y] * n, p, left=lefts, height=0.8, color=[cmap(c) for c in shades], edgecolor="white", linewidth=0.4)
        for j, (w, left, shade) in enumerate(zip(p, lefts, shades)):
            if w >= 0.07:
                label = _segment_label(tra.series_names[s], tra.op_names[s][j])
                if w >= 0.2:
                    label = f"{label}={w:.2f}"
                dark = shade > 0.55
                ax.text(
                    left + w / 2, y, label, ha="center", va="center", fontsize=6,
                    color="white" if dark else "black", clip_on=True,
                )  # fmt: skip
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.6, n_series - 0.4)
    ax.set_yticks(range(n_series))
    ax.set_yticklabels(list(reversed(tra.series_names)) if show_names else [], fontsize=7)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel("probability", fontsize=7)
    title = f"TRA, class group {group}" if tra.num_groups > 1 else "TRA policy"
    ax.set_title(title, fontsize=9)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _draw_tea(ax: Any, tea: CategoricalPolicy, top_k: int) -> None:
    p = tea.probabilities()[0][0].numpy()
    names = tea.op_names[0]
    k = max(1, min(int(top_k), len(p)))
    order = np.argsort(-p, kind="stable")[:k]
    y = np.arange(k)[::-1]
    ax.barh(y, p[order], height=0.7, color="#3b6ea8")
    for yi, i in zip(y, order):
        ax.text(p[i], yi, f" {p[i]:.3f}", va="center", ha="left", fontsize=6)
    ax.axvline(1.0 / len(p), color="0.4", linestyle="--", linewidth=0.8, label=f"uniform 1/{len(p)}")
    ax.set_yticks(y)
    ax.set_yticklabels([f"{names[i]} ({i})" for i in order], fontsize=7)
    ax.set_xlim(0, float(p[order].max()) * 1.3)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel("probability", fontsize=7)
    ax.set_title(f"TEA policy, top {k} of {len(p)} ops", fontsize=9)
    ax.legend(fontsize=6, loc="lower right", frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _draw_changes(ax: Any, changes: list, title: str, top_k: int) -> None:
    """Horizontal bars of the ``top_k`` largest probability changes (green up, red down)."""
    shown = changes[: max(1, int(top_k))]
    y = np.arange(len(shown))[::-1]
    deltas = np.array([c.delta for c in shown])
    ax.barh(y, deltas, height=0.7, color=["#3a8f4b" if d >= 0 else "#b8433a" for d in deltas])
    ax.axvline(0.0, color="0.3", linewidth=0.8)
    ax.set_yticks(y)
    ax.set_yticklabels([f"{c.label} {c.start:.3f}→{c.end:.3f}" for c in shown], fontsize=6)
    reach = float(np.abs(deltas).max()) if len(deltas) else 0.0
    ax.set_xlim(-1.15 * reach - 1e-9, 1.15 * reach + 1e-9)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel("change of probability from the start", fontsize=7)
    ax.set_title(title, fontsize=9)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def policy_figsize(num_groups: int, has_tea: bool, with_changes: bool = False) -> tuple[float, float]:
    """Default size (inches) of :func:`plot_policy`'s figure."""
    width = 1.6 + 3.6 * num_groups + (4.0 if has_tea else 0.0)
    return (max(width, 5.0), 9.6 if with_changes else 5.2)


def plot_policy(
    policies: str | Path | Sequence[Any],
    out_png: str | Path,
    top_k: int = 12,
    *,
    initial: str | Path | Sequence[Any] | None = None,
    figsize: tuple[float, float] | None = None,
    dpi: int = 120,
) -> Path:
    """Plot learned policies: one stacked-bar panel per TRA class group, and the TEA policy's top-k ops; with
    ``initial``, a second row with the ops whose probabilities changed most from it.

    Args:
        policies: a ``policies.json`` path, or a ``(tra, tea)`` pair of :class:`CategoricalPolicy`
            (either may be ``None``).
        out_png: the PNG to write.
        top_k: number of TEA ops shown (most probable first), and of changed ops per panel.
        initial: the policies at the start (same forms as ``policies``): adds the change panels.
        figsize, dpi: figure size in inches (default :func:`policy_figsize`) and resolution.

    In a TRA panel each series is one bar split into its ops' probabilities, shaded from the identity
    (lightest) to the largest magnitude (darkest); labels: ``id`` identity, ``1``-``5`` magnitude level,
    ``90°`` quarter turn, ``flip`` mirror, ``b``/``s`` blur/sharpen level; probabilities >= 0.2 printed.
    """
    from jcsaug.policy.changes import policy_changes  # noqa: PLC0415

    tra, tea = _resolve_policies(policies)
    no_start = initial is None or (isinstance(initial, (list, tuple)) and all(p is None for p in initial))
    start_tra, start_tea = (None, None) if no_start else _resolve_policies(initial)
    start_tra = start_tra if tra is not None and start_tra is not None else None
    start_tea = start_tea if tea is not None and start_tea is not None else None
    with_changes = start_tra is not None or start_tea is not None
    groups = tra.num_groups if tra is not None else 0
    fig = _new_figure(figsize or policy_figsize(groups, tea is not None, with_changes), dpi)
    ratios = [1.0] * groups + ([1.15] if tea is not None else [])
    rows = 2 if with_changes else 1
    axes = np.asarray(fig.subplots(rows, len(ratios), width_ratios=ratios, squeeze=False))
    if tra is not None:
        probs = [p.numpy() for p in tra.probabilities()]
        for g in range(groups):
            _draw_tra_group(axes[0, g], tra, probs, g, show_names=g == 0)
            if start_tra is not None:
                title = f"TRA group {g}: most changed" if groups > 1 else "TRA: most changed"
                _draw_changes(axes[1, g], policy_changes(tra, start_tra, g), title, top_k)
            elif with_changes:
                axes[1, g].set_visible(False)
    if tea is not None:
        _draw_tea(axes[0, -1], tea, top_k)
        if start_tea is not None:
            _draw_changes(axes[1, -1], policy_changes(tea, start_tea), "TEA: most changed", top_k)
        elif with_changes:
            axes[1, -1].set_visible(False)
    if tra is not None:
        fig.supxlabel(
            "TRA bars: id identity, 1-5 magnitude level (darker = larger), 90° quarter turn, flip mirror, "
            "b/s blur/sharpen level; =p probability",
            fontsize=7, color="0.3",
        )  # fmt: skip
    return _save(fig, out_png)


# ----------------------------------------------------------------------------- history figure
def read_policy_history(path: str | Path) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]]]:
    """Read a ``policy_history.jsonl``: ``(iterations [T], {panel: {line label: probabilities [T]}})``.

    Panels are ``"TRA group g"`` (``"TRA"`` for a one-group policy) and ``"TEA"``; lines are
    ``"series: op"`` (TRA) or the op name (TEA). A later record of an iteration already seen (a resumed
    run) replaces the earlier one. A last line that is not a record (cut off by an interruption) is skipped with a
    warning; a bad line before it is an error naming the file and the line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no policy history {path}")
    lines = [(n, line) for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    by_iteration: dict[int, dict[str, float]] = {}
    for n, line in lines:
        try:
            record = json.loads(line)
            by_iteration[int(record["iteration"])] = {str(k): float(v) for k, v in record["probabilities"].items()}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
            if n == lines[-1][0]:
                warnings.warn(f"{path}:{n}: skipped an incomplete last record ({err})", stacklevel=2)
                continue
            raise ValueError(f"{path}:{n}: not a policy history record ({err})") from None
    if not by_iteration:
        raise ValueError(f"{path} holds no policy history records")
    iterations = np.array(sorted(by_iteration))
    panels: dict[str, dict[str, np.ndarray]] = {}
    tags = sorted({t for r in by_iteration.values() for t in r}, key=_tag_order)
    for tag in tags:
        panel, label = _parse_tag(tag)
        values = np.array([by_iteration[i].get(tag, np.nan) for i in iterations], dtype=float)
        panels.setdefault(panel, {})[label] = values
    return iterations, panels


def _parse_tag(tag: str) -> tuple[str, str]:
    prefix, _, rest = tag.partition("/")
    if prefix == "tea":
        return "TEA", rest.partition("/")[2] if rest.startswith("tea/") else rest
    if prefix == "tra":
        head, _, tail = rest.partition("/")
        if head.startswith("group") and head[5:].isdigit() and "/" in tail:
            panel, rest = f"TRA group {int(head[5:])}", tail
        else:
            panel = "TRA"
        series, _, op = rest.partition("/")
        return panel, f"{series}: {op}"
    return prefix.upper() or "other", rest


def _tag_order(tag: str) -> tuple:
    prefix, _, rest = tag.partition("/")
    head = rest.partition("/")[0]
    group = int(head[5:]) if head.startswith("group") and head[5:].isdigit() else -1
    return (prefix != "tra", group)  # TRA groups first, TEA last; file order kept inside a panel


def plot_policy_history(
    history_jsonl: str | Path,
    out_png: str | Path,
    top_k: int = 8,
    *,
    figsize: tuple[float, float] | None = None,
    dpi: int = 120,
) -> Path:
    """Plot the evolution of op probabilities over training (x = iteration).

    One panel per TRA class group and one for TEA, each with the ``top_k`` ops whose probability moved
    furthest from its first value.
    """
    iterations, panels = read_policy_history(history_jsonl)
    names = list(panels)
    ncols = min(3, len(names))
    nrows = math.ceil(len(names) / ncols)
    fig = _new_figure(figsize or (4.6 * ncols, 4.4 * nrows), dpi)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    marker = "o" if len(iterations) < 30 else None
    for ax, name in zip(axes, names):
        lines = panels[name]
        change = {k: float(np.nanmax(np.abs(v - v[0]))) if np.isfinite(v).any() else 0.0 for k, v in lines.items()}
        moved = [k for k in lines if change[k] > 1e-4] or list(lines)  # unchanged ops only if nothing moved
        top = sorted(moved, key=lambda k: -change[k])[: max(1, int(top_k))]
        for label in top:
            ax.plot(iterations, lines[label], marker=marker, markersize=3, linewidth=1.2, label=label)
        ax.set_title(f"{name} (top {len(top)} of {len(lines)} ops by change)", fontsize=9)
        ax.set_xlabel("iteration", fontsize=7)
        ax.set_ylabel("probability", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    return _save(fig, out_png)


# ----------------------------------------------------------------------------- gallery
def load_volume(image_path: str | Path) -> np.ndarray:
    """A NIfTI (or any MONAI-readable) image as ``[X, Y, Z]`` float32, in RAS orientation (first channel)."""
    from monai.transforms import Compose, EnsureChannelFirst, LoadImage, Orientation  # noqa: PLC0415

    path = Path(image_path)
    if not path.is_file():
        raise FileNotFoundError(f"no image {path}")
    load = Compose([
        LoadImage(image_only=True),
        EnsureChannelFirst(),
        Orientation(axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S"))),
    ])  # fmt: skip
    try:
        img = load(str(path))
    except Exception as err:  # MONAI wraps reader errors in RuntimeError / OSError / ValueError
        raise ValueError(f"cannot read image {path}: {err}") from None
    vol = np.asarray(img[0], dtype=np.float32)
    if vol.ndim != 3:
        raise ValueError(f"{path}: expected a 3D volume, got spatial shape {tuple(vol.shape)}")
    return vol


def _middle_slice(vol: np.ndarray, axis: int) -> np.ndarray:
    """The middle slice of ``[X, Y, Z]`` along ``axis``, oriented for ``imshow(origin="lower")``."""
    return np.take(vol, vol.shape[axis] // 2, axis=axis).T


def _show(ax: Any, img: np.ndarray, title: str, window: tuple[float, float], fontsize: float) -> None:
    ax.imshow(img, cmap="gray", origin="lower", vmin=window[0], vmax=window[1], interpolation="nearest")
    ax.set_anchor("N")  # image right under its title, whatever its aspect
    ax.set_title(title, fontsize=fontsize, pad=2)
    ax.set_xticks([])
    ax.set_yticks([])


_TILE_W, _TEA_ROW_H, _TRA_ROW_H, _HEADER_H = 1.3, 1.45, 1.7, 0.4  # inches: gallery tile / row / block header


def gallery_figsize(num_tea_tiles: int, num_tra_tiles: int, ncols: int = 12) -> tuple[float, float]:
    """Size (inches) of :func:`ops_gallery`'s figure for these numbers of tiles."""
    tea_rows, tra_rows = math.ceil(num_tea_tiles / ncols), math.ceil(num_tra_tiles / ncols)
    height = tea_rows * _TEA_ROW_H + _HEADER_H + (tra_rows * _TRA_ROW_H + _HEADER_H if tra_rows else 0.0)
    return (ncols * _TILE_W, height)


def ops_gallery(
    image_path: str | Path,
    out_png: str | Path,
    slice_axis: int = 2,
    tra_draws: int = 6,
    seed: int = 0,
    *,
    tra_policy: CategoricalPolicy | None = None,
    normalize: bool = True,
    ncols: int = 12,
    dpi: int = 120,
) -> Path:
    """A labelled grid of the 84 TEA ops and of TRA draws per class group, on a volume's middle slice.

    Every op is applied to the whole volume ``[1, X, Y, Z]`` and the middle slice along ``slice_axis``
    (0 sagittal, 1 frontal, 2 axial) of the result is shown, all tiles in the original slice's grey
    window so that intensity ops are visible. TRA draws come from ``tra_policy`` (default: the
    ``nnunet`` preset with 2 groups); each tile's title lists its non-identity ops by short name (e.g.
    ``sc2`` scale level 2, ``rotL90`` quarter turn about the longitudinal axis, ``mirS`` mirror).

    Args:
        normalize: z-score the volume first (the ops' magnitudes assume normalised intensities).
    """
    import torch  # noqa: PLC0415

    from jcsaug.ops.tea import TEA_OPS  # noqa: PLC0415
    from jcsaug.ops.tra import apply_tra, sample_tra_params, tra_catalogue, tra_catalogue_name  # noqa: PLC0415
    from jcsaug.policy.factory import make_tra_policy  # noqa: PLC0415

    if slice_axis not in (0, 1, 2):
        raise ValueError(f"slice_axis must be 0, 1 or 2, got {slice_axis}")
    _matplotlib()  # fail early, before the (slow) ops
    vol = load_volume(image_path)
    if normalize:
        vol = (vol - vol.mean()) / max(float(vol.std()), 1e-8)
    x = torch.from_numpy(np.ascontiguousarray(vol))[None]
    window = tuple(float(v) for v in np.percentile(vol, [0.5, 99.5]))
    if window[1] <= window[0]:
        window = (window[0], window[0] + 1.0)

    tea_tiles = []
    with torch.no_grad():
        for op in TEA_OPS:
            out = op.transform_image(x)[0].numpy()
            tea_tiles.append((_middle_slice(out, slice_axis), _split_name(f"{op.id} {op.name}")))

    policy = tra_policy if tra_policy is not None else make_tra_policy("nnunet", 2)
    catalogue = tra_catalogue_name(policy.op_names)
    rng = np.random.RandomState(seed)
    tra_tiles = []
    with torch.no_grad():
        for g in range(policy.num_groups):
            for d in range(max(0, int(tra_draws))):
                choices = policy.sample_ops(g, rng)
                params = sample_tra_params(choices, rng, tra_catalogue(catalogue))
                out = apply_tra({"image": x}, {}, params)[0]["image"][0].numpy()
                ops = [tra_short_name(s, c, catalogue) for s, c in enumerate(choices) if c != 0]
                tra_tiles.append((_middle_slice(out, slice_axis), f"g{g} #{d + 1}\n" + _wrap(ops or ["identity"])))

    fig = _new_figure(gallery_figsize(len(tea_tiles), len(tra_tiles), ncols), dpi, layout=None)
    axis_name = ("sagittal", "frontal", "axial")[slice_axis]
    blocks = [(tea_tiles, _TEA_ROW_H, f"TEA: the {len(tea_tiles)} test-time ops ({axis_name} middle slice)")]
    if tra_tiles:
        title = f"TRA: {tra_draws} draws per class group (seed {seed}); digits = magnitude level, 1 smallest"
        blocks.append((tra_tiles, _TRA_ROW_H, title))
    # fixed grid in inches (a layout engine is slow with ~100 axes): header, then rows of tiles
    width, height = fig.get_size_inches()
    top = height
    for tiles, row_h, title in blocks:
        fig.text(0.5, (top - 0.12) / height, title, ha="center", va="top", fontsize=10, fontweight="bold")
        top -= _HEADER_H
        title_h = 0.3 if row_h == _TEA_ROW_H else 0.5  # room for 2 / 3 title lines
        for i, (img, label) in enumerate(tiles):
            row, col = divmod(i, ncols)
            left = col * _TILE_W + 0.04
            bottom = top - (row + 1) * row_h + 0.04
            rect = (left / width, bottom / height, (_TILE_W - 0.08) / width, (row_h - title_h - 0.04) / height)
            _show(fig.add_axes(rect), img, label, window, fontsize=5.5)
        top -= math.ceil(len(tiles) / ncols) * row_h
    return _save(fig, out_png)


def _split_name(name: str, width: int = 21) -> str:
    """Break a long ``snake_case`` name into two lines at the last ``_`` that fits ``width``."""
    if len(name) <= width:
        return name
    cut = name.rfind("_", 0, width)
    return name if cut <= 0 else f"{name[:cut]}\n{name[cut:]}"


def _wrap(names: Sequence[str], width: int = 22) -> str:
    """Join names with spaces, breaking lines at about ``width`` characters."""
    lines, line = [], ""
    for name in names:
        if line and len(line) + 1 + len(name) > width:
            lines.append(line)
            line = name
        else:
            line = f"{line} {name}" if line else name
    lines.append(line)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def build_policy_plot_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``jcsaug policy plot PATH [-o OUT.png] [--history policy_history.jsonl]``."""
    p.add_argument("path", help="a policies.json written by a run")
    p.add_argument("-o", "--output", help="PNG to write (default: PATH with suffix .png)")
    p.add_argument(
        "--history",
        metavar="JSONL",
        help="also plot this policy_history.jsonl, to <output stem>_history.png",
    )
    p.add_argument(
        "--initial",
        metavar="JSON",
        help="the policies at the start (a policies.json, e.g. from `jcsaug policy show --preset nnunet --json`): "
        "adds the ops whose probabilities changed most",
    )
    p.add_argument("--top-k", type=int, default=12, help="TEA ops (and changed ops) shown (default 12)")
    p.add_argument("--history-top-k", type=int, default=8, help="ops per history panel (default 8)")
    p.add_argument("--dpi", type=int, default=120)


def run_policy_plot(args: argparse.Namespace) -> int:
    """Run ``jcsaug policy plot``: print the written paths; errors on stderr, exit status 2."""
    out = Path(args.output) if args.output else Path(args.path).with_suffix(".png")
    try:
        _matplotlib()
        if args.history:
            read_policy_history(args.history)  # check the inputs before drawing anything
        written = [plot_policy(args.path, out, top_k=args.top_k, initial=args.initial, dpi=args.dpi)]
        if args.history:
            hist_out = out.with_name(f"{out.stem}_history.png")
            written.append(plot_policy_history(args.history, hist_out, top_k=args.history_top_k, dpi=args.dpi))
    except (ImportError, OSError, ValueError, KeyError) as err:
        print(f"jcsaug policy plot: {_message(err)}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def build_gallery_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``jcsaug ops gallery IMAGE [-o OUT.png]``."""
    p.add_argument("image", help="a 3D NIfTI volume (.nii / .nii.gz)")
    p.add_argument("-o", "--output", help="PNG to write (default: ./<image name>_gallery.png)")
    p.add_argument("--slice-axis", type=int, choices=(0, 1, 2), default=2, help="0 sagittal, 1 frontal, 2 axial")
    p.add_argument("--tra-draws", type=int, default=6, help="TRA draws per class group (default 6; 0 = none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", help="draw TRA ops from this policies.json (default: the nnunet preset, 2 groups)")
    p.add_argument("--no-normalize", action="store_true", help="do not z-score the volume first")
    p.add_argument("--dpi", type=int, default=120)


def run_gallery(args: argparse.Namespace) -> int:
    """Run ``jcsaug ops gallery``: print the written path; errors on stderr, exit status 2."""
    name = Path(args.image).name
    for suffix in (".nii.gz", ".nii"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    out = Path(args.output) if args.output else Path(f"{name}_gallery.png")
    try:
        tra = None
        if args.policy:
            tra, _ = _resolve_policies(args.policy)
            if tra is None:
                raise ValueError(f"{args.policy} holds no TRA policy")
        path = ops_gallery(
            args.image, out, slice_axis=args.slice_axis, tra_draws=args.tra_draws, seed=args.seed,
            tra_policy=tra, normalize=not args.no_normalize, dpi=args.dpi,
        )  # fmt: skip
    except (ImportError, OSError, ValueError, KeyError) as err:
        print(f"jcsaug ops gallery: {_message(err)}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _message(err: BaseException) -> str:
    return str(err.args[0]) if err.args else str(err)
