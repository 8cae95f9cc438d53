"""Figures of policies and op catalogues (needs the optional ``plot`` extra: ``pip install "jcsaug[plot]"``).

matplotlib is imported only when a figure is drawn, so importing this package is always safe.
"""

from jcsaug.viz.handler import PolicyPlotter
from jcsaug.viz.plots import (
    PLOT_INSTALL_HINT,
    build_gallery_parser,
    build_policy_plot_parser,
    load_volume,
    ops_gallery,
    plot_policy,
    plot_policy_history,
    read_policy_history,
    run_gallery,
    run_policy_plot,
    tra_short_name,
)

__all__ = [
    "PLOT_INSTALL_HINT",
    "PolicyPlotter",
    "build_gallery_parser",
    "build_policy_plot_parser",
    "load_volume",
    "ops_gallery",
    "plot_policy",
    "plot_policy_history",
    "read_policy_history",
    "run_gallery",
    "run_policy_plot",
    "tra_short_name",
]
