"""The benchmark's chart: each case's speed as a fraction of the device's own ceiling.

One panel per family of a report (the dict of ``results.json``), one pair of bars per case:
oxmoe and its plain-JAX baseline, each as ``ceiling time / its time``, where the ceiling is
measured in the same run: the byte floor at the copy bandwidth (router, permutation,
activation) or the dense bf16 GEMM of the same FLOPs (grouped_gemm, moe_layer). A dashed line
marks the family's goal. :func:`chart_rows` gives the numbers the chart plots;
:func:`write_chart` draws them with matplotlib (imported only here: ``pip install 'oxmoe[tools]'``).
"""

from __future__ import annotations

import dataclasses
import datetime
import pathlib
from typing import NamedTuple

from oxmoe.bench.cases import format_gbps

#: Resolution of the PNG, and the figure's width in inches.
DPI = 120
WIDTH_IN = 12.0
#: Height of one case's pair of bars, of a panel's title and axis, and of the figure's title.
CASE_IN, PANEL_IN, TITLE_IN = 0.34, 1.0, 0.9

OXMOE_COLOR, BASELINE_COLOR, GOAL_COLOR, NOTE_COLOR = "#1f6fb4", "#a8a8a8", "#c0392b", "#555555"


@dataclasses.dataclass(frozen=True)
class Panel:
    """What a family's fractions are of, and which of its case's timings is the baseline."""

    copy_ceiling: bool
    """Whether 100% is the byte floor at the copy bandwidth (else a dense GEMM of the same FLOPs)."""
    baseline: str
    """The key of the baseline's timing in a case (a dict, ``"OOM"`` or None)."""
    baseline_label: str


PANELS = {
    "router": Panel(True, "plain_jax", "plain JAX"),
    "permutation": Panel(True, "plain_jax", "plain JAX"),
    "activation": Panel(True, "plain_jax", "plain JAX"),
    "grouped_gemm": Panel(False, "ragged_dot", "jax.lax.ragged_dot"),
    "moe_layer": Panel(False, "plain_jax", "the plain-JAX layer"),
}


class ChartRow(NamedTuple):
    family: str
    case: str
    oxmoe_fraction: float | None
    """None: the case failed or was skipped."""
    plain_fraction: float | None
    """None: the baseline was not timed (out of memory, an error, an expert-parallel case)."""
    goal: float
    """The family's goal for oxmoe, as a fraction of the same ceiling."""


def _ceiling_us(case: dict) -> float | None:
    """The time the case would take at the ceiling."""
    if PANELS[case["family"]].copy_ceiling:
        return case["floor_us"]
    return case["dense"]["median_us"] if case["dense"] else None


def _fraction(ceiling_us: float | None, timing) -> float | None:
    """``ceiling time / timing's median``; None for a timing that is not one (None, "OOM")."""
    return ceiling_us / timing["median_us"] if ceiling_us and isinstance(timing, dict) else None


def _goal(report: dict, family: str) -> float:
    goals = report["families"][family]["goals"]
    return goals["min_fraction_of_copy"] if "min_fraction_of_copy" in goals else goals["min_fraction_of_dense"]


def chart_rows(report: dict) -> list[ChartRow]:
    """The chart's numbers, one row per case of the report, in the report's order."""
    rows = []
    for case in report["cases"]:
        family, ceiling_us = case["family"], _ceiling_us(case)
        rows.append(ChartRow(family, case["name"], _fraction(ceiling_us, case["oxmoe"]),
                             _fraction(ceiling_us, case[PANELS[family].baseline]), _goal(report, family)))
    return rows


def matplotlib_figure():
    """matplotlib's ``Figure``; without matplotlib an ImportError that names the extra to install
    (the benchmark calls this before it measures anything)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("the benchmark's chart needs matplotlib: pip install 'oxmoe[tools]'") from e
    return Figure


def figure_size(rows: list[ChartRow]) -> tuple[float, float]:
    """The figure's (width, height) in inches: a fixed height per case and per panel."""
    families = {row.family for row in rows}
    return WIDTH_IN, TITLE_IN + PANEL_IN * len(families) + CASE_IN * len(rows)


def _title(report: dict) -> str:
    date = datetime.datetime.fromisoformat(report["date"])
    return (f"oxmoe {report['oxmoe_build_id']} on {report['device']} ({report['platform']}), "
            f"{date:%Y-%m-%d %H:%M} UTC, jax {report['jax_version']}{', smoke' if report['smoke'] else ''}\n"
            "each case's speed as a fraction of the device's ceiling measured in the same run (higher is better)")


def _panel_title(report: dict, family: str, goal: float) -> str:
    panel = PANELS[family]
    copy_gbps = format_gbps(report["copy"]["gb_per_s"] * 1e9)
    ceiling = (f"the byte floor at the copy bandwidth ({copy_gbps} GB/s)" if panel.copy_ceiling
               else "a dense bf16 GEMM of the same FLOPs")
    return f"{family}: oxmoe and {panel.baseline_label}; 100% = {ceiling}; goal >= {100 * goal:g}%"


def _missing_text(case: dict, key: str) -> str:
    """Why a bar is missing: the case's or its baseline's outcome."""
    if key == "oxmoe":
        return f"skipped: {case['skipped']}" if case.get("skipped") else "FAILED"
    value = case[key]
    if isinstance(value, str):  # e.g. "OOM"
        return value
    if case.get("devices", 1) > 1:
        return f"expert parallelism over {case['devices']} devices: no plain-JAX baseline, no goal"
    return "error" if case.get(f"{key}_error") else "not timed"


def _draw_panel(ax, report: dict, family: str, rows: list[ChartRow], cases: list[dict]) -> None:
    panel, goal = PANELS[family], rows[0].goal
    values = [v for row in rows for v in (row.oxmoe_fraction, row.plain_fraction) if v is not None]
    right = 1.15 * max([1.0, goal, *values])  # room for the labels right of the bars
    pad, bar = 0.005 * right, 0.4
    oxmoe, plain = -bar / 2, bar / 2  # each bar's offset from its case's tick

    def label(x, y, text, **style):
        ax.text(x, y, text, va="center", fontsize=8, **style)

    for offset, color, fractions in ((oxmoe, OXMOE_COLOR, [row.oxmoe_fraction for row in rows]),
                                     (plain, BASELINE_COLOR, [row.plain_fraction for row in rows])):
        drawn = [(y + offset, value) for y, value in enumerate(fractions) if value is not None]
        if drawn:
            ax.barh(*zip(*drawn), height=bar, color=color)
    for y, (row, case) in enumerate(zip(rows, cases)):
        if row.oxmoe_fraction is None:  # not run: one note for the case
            label(pad, y, _missing_text(case, "oxmoe"), color=NOTE_COLOR)
            continue
        label(row.oxmoe_fraction + pad, y + oxmoe, f"{100 * row.oxmoe_fraction:.0f}%")
        if row.plain_fraction is None:
            label(pad, y + plain, _missing_text(case, panel.baseline), color=NOTE_COLOR)
        else:
            label(row.plain_fraction + pad, y + plain, f"{100 * row.plain_fraction:.0f}%")
    ax.axvline(goal, color=GOAL_COLOR, linestyle="--", linewidth=1.2)
    ax.set_yticks(range(len(rows)), [row.case for row in rows], fontsize=9)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first case on top
    ax.set_xlim(0, right)
    ax.xaxis.set_major_formatter(lambda x, _: f"{100 * x:.0f}%")
    ax.grid(axis="x", color="#dddddd", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.set_title(_panel_title(report, family, goal), loc="left", fontsize=11)


def write_chart(report: dict, path: pathlib.Path) -> None:
    """Draws :func:`chart_rows` of ``report`` to the PNG ``path`` (:data:`DPI`, :func:`figure_size`)."""
    Figure = matplotlib_figure()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = chart_rows(report)
    families = list(dict.fromkeys(row.family for row in rows))
    sizes = [sum(row.family == family for row in rows) for family in families]
    width, height = figure_size(rows)
    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    # The title and the legend above the panels, in the top TITLE_IN inches that the layout leaves free.
    figure.get_layout_engine().set(rect=(0, 0, 1, 1 - TITLE_IN / height))
    figure.suptitle(_title(report), y=1 - 0.08 / height, va="top", fontsize=12, in_layout=False)
    figure.legend(handles=[Patch(color=OXMOE_COLOR, label="oxmoe"),
                           Patch(color=BASELINE_COLOR, label="plain-JAX baseline (named in each panel's title)"),
                           Line2D([], [], color=GOAL_COLOR, linestyle="--", label="the family's goal for oxmoe")],
                  loc="upper center", bbox_to_anchor=(0.5, 1 - 0.52 / height), ncols=3, frameon=False,
                  fontsize=10)
    axes = figure.subplots(len(families), 1, squeeze=False,
                           gridspec_kw=dict(height_ratios=[size + PANEL_IN / CASE_IN for size in sizes]))
    for ax, family in zip(axes[:, 0], families):
        family_rows = [row for row in rows if row.family == family]
        _draw_panel(ax, report, family, family_rows, [case for case in report["cases"] if case["family"] == family])
    figure.savefig(path, dpi=DPI)
