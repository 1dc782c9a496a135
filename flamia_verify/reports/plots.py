"""Plots for the HTML report, drawn from ``CheckResult.details`` as inline SVG with matplotlib.

The check engine asks for a plot by adding a plain-JSON description under one of three keys of a check's
``details``; the HTML report draws every one it finds, in order. All text fields are optional strings and
default to ``""``; every number may also be one of the strings ``"nan"``, ``"inf"``, ``"-inf"``.

``details["series"]``: list of line plots, e.g. error against token position, or kernel error vs BF16::

    {"title": str, "x_label": str, "y_label": str,
     "x": [number, ...],                    # optional; defaults to 0, 1, 2, ...
     "ys": {label: [number, ...], ...},     # required, one line per label, each as long as x
     "log_y": bool, "log_x": bool,          # optional, default false
     "thresholds": {label: number, ...}}    # optional horizontal dashed lines (e.g. the check's limit)

``details["histograms"]``: list of histograms drawn as overlaid step outlines, e.g. error per tensor::

    {"title": str, "x_label": str, "y_label": str (default "count"),
     "bin_edges": [number, ...],            # required, n + 1 increasing edges
     "counts": {label: [number, ...], ...}, # required, n counts per label
     "log_y": bool, "log_x": bool}          # optional (log_x suits log-spaced error bins)

``details["heatmaps"]``: list of 2-D maps, e.g. leakage maps (which query positions moved when the keys
after them changed)::

    {"title": str, "x_label": str, "y_label": str, "z_label": str (colour bar),
     "z": [[number, ...], ...],             # required, rectangular; z[row][col], row 0 drawn at the top
     "x": [value, ...],                     # optional column coordinates (len = columns), used as tick labels
     "y": [value, ...],                     # optional row coordinates (len = rows)
     "log_z": bool}                         # optional log colour scale

How the data is drawn, so that a reader can trust what is *not* on a plot:
- Lines longer than `MAX_LINE_POINTS` are decimated by keeping the minimum and the maximum of each bucket,
  so a single spike (a leaking position, a NaN-poisoned row) always survives.
- Non-finite points of a line are drawn as red crosses along the top edge ("non-finite" in the legend);
  non-finite heatmap cells are drawn in magenta, and the title says how many there are.
- Heatmaps wider or taller than `MAX_HEATMAP_SIDE` cells are max-pooled by absolute value (the sign of the
  largest magnitude is kept), so one leaking cell stays visible.
- A log axis with no positive value falls back to linear, and the title says so. On a log y axis, the
  points of a line at or below 0 (an exact zero error) are drawn as triangles on the bottom edge, the
  axis floor ("≤ 0, at the axis floor" in the legend), and the title says how many; points at x ≤ 0 on
  a log x axis, and histogram bins of count 0 on a log y axis, cannot be drawn, and the title says how
  many were left out.
- A heatmap whose every cell is exactly 0 (a leakage map where nothing leaked) is not drawn: a map of one
  colour says nothing. `blank_heatmap` finds it and the HTML report states it in one line instead (its
  title, the shape, and that every cell is 0). A map with any non-zero or non-finite cell is drawn.

A description that breaks these rules raises `PlotSpecError` naming the field
(``details.series[0].ys['kernel']``); the HTML report shows that message in place of the plot instead of
failing the whole report. Rendered plots are cached by content, so rewriting a report after every check
costs only the new plots.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import textwrap
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MAX_FLOOR_MARKERS",
    "MAX_HEATMAP_SIDE",
    "MAX_LINE_POINTS",
    "PLOT_KINDS",
    "Plot",
    "PlotSpecError",
    "blank_heatmap",
    "plots_of",
    "prefix_svg_ids",
    "render_plot_svg",
]

#: The keys of ``CheckResult.details`` that hold plot descriptions, in drawing order.
PLOT_KINDS = ("series", "histograms", "heatmaps")
#: Points per line kept after min/max decimation (1000 buckets x 2): well above an 800-pixel-wide plot.
MAX_LINE_POINTS = 2000
#: Cells per side of a heatmap after max-pooling: a 256 x 256 map still resolves single cells on screen.
MAX_HEATMAP_SIDE = 256
#: Rendered SVGs kept in memory, keyed by a digest of the description.
_CACHE_SIZE = 256

_LINE_SIZE = (6.4, 3.6)  # inches; drawn at 72 points per inch, scaled by the page
_HEATMAP_SIZE = (6.4, 4.8)
_NONFINITE_COLOR = "#d62728"
_BAD_CELL_COLOR = "magenta"


class PlotSpecError(ValueError):
    """A plot description in ``CheckResult.details`` that does not follow the conventions above."""


@dataclass(frozen=True)
class Plot:
    """One plot description found in a check's details: ``details[kind][index]``."""

    kind: str
    index: int
    spec: Any

    @property
    def where(self) -> str:
        return f"details.{self.kind}[{self.index}]"

    @property
    def title(self) -> str:
        if isinstance(self.spec, dict) and isinstance(self.spec.get("title"), str):
            return str(self.spec["title"])
        return ""


def plots_of(details: Any) -> list[Plot]:
    """The plot descriptions in a check's `details`, in the order they are drawn (unvalidated)."""
    if not isinstance(details, dict):
        return []
    found: list[Plot] = []
    for kind in PLOT_KINDS:
        entries = details.get(kind)
        if entries is None:
            continue
        if not isinstance(entries, list):
            entries = [entries]  # a lone description: drawn, and flagged by validation if malformed
        found.extend(Plot(kind, i, spec) for i, spec in enumerate(entries))
    return found


def blank_heatmap(plot: Plot) -> tuple[int, int] | None:
    """``(rows, columns)`` of a heatmap description whose every cell is exactly 0, else None (also for a
    malformed description, which drawing then reports, and for a map holding NaN or infinities)."""
    if plot.kind != "heatmaps" or not isinstance(plot.spec, dict):
        return None
    rows = plot.spec.get("z")
    if (
        not isinstance(rows, list)
        or not rows
        or not all(isinstance(r, (list, tuple)) and len(r) == len(rows[0]) and len(r) > 0 for r in rows)
    ):
        return None
    try:
        z = np.stack([_vector(r, f"{plot.where}.z[{i}]") for i, r in enumerate(rows)])
    except PlotSpecError:
        return None
    return (int(z.shape[0]), int(z.shape[1])) if bool(np.all(z == 0.0)) else None


# ------------------------------------------------------------------------------------------ validation


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise PlotSpecError(f"{where}: expected a number, got a boolean")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "+inf", "-inf"):
        return float(value.strip().lower())
    raise PlotSpecError(f"{where}: expected a number (or 'nan'/'inf'/'-inf'), got {type(value).__name__}")


def _vector(value: Any, where: str, *, min_len: int = 1) -> np.ndarray:
    if not isinstance(value, (list, tuple)):
        raise PlotSpecError(f"{where}: expected a list of numbers, got {type(value).__name__}")
    if len(value) < min_len:
        raise PlotSpecError(f"{where}: expected at least {min_len} value(s), got {len(value)}")
    return np.array([_number(v, f"{where}[{i}]") for i, v in enumerate(value)], dtype=np.float64)


def _text(spec: dict[str, Any], key: str, where: str, default: str = "") -> str:
    value = spec.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise PlotSpecError(f"{where}.{key}: expected a string, got {type(value).__name__}")
    return value


def _flag(spec: dict[str, Any], key: str, where: str) -> bool:
    value = spec.get(key, False)
    if not isinstance(value, bool):
        raise PlotSpecError(f"{where}.{key}: expected true or false, got {value!r}")
    return value


def _labelled(spec: dict[str, Any], key: str, where: str, length: int | None) -> dict[str, np.ndarray]:
    if key not in spec:
        raise PlotSpecError(f"{where}.{key} is missing")
    group = spec[key]
    if not isinstance(group, dict) or not group:
        raise PlotSpecError(f"{where}.{key}: expected a non-empty object of label -> list of numbers")
    out: dict[str, np.ndarray] = {}
    for label, values in group.items():
        vec = _vector(values, f"{where}.{key}[{label!r}]")
        if length is not None and len(vec) != length:
            raise PlotSpecError(f"{where}.{key}[{label!r}]: has {len(vec)} values, expected {length}")
        out[str(label)] = vec
    return out


# --------------------------------------------------------------------------------------------- drawing


def _mpl_text(text: str, width: int = 70) -> str:
    """Text as matplotlib draws it literally: ``$`` would start mathtext, which can fail on any input."""
    text = text.replace("\\", "\\\\").replace("$", r"\$")
    return "\n".join(textwrap.wrap(text, width)) if len(text) > width else text


def _legend_label(label: str) -> str:
    # matplotlib hides legend entries whose label starts with an underscore.
    return "\u200b" + label if label.startswith("_") else label


def _decimate(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep the min and max of each of max_points/2 buckets, in x order; NaNs are kept as gaps elsewhere."""
    n = len(y)
    if n <= max_points:
        return x, y
    buckets = max_points // 2
    edges = np.linspace(0, n, buckets + 1).astype(int)
    keep: list[int] = []
    finite = np.isfinite(y)
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        idx = np.arange(lo, hi)[finite[lo:hi]]
        if len(idx) == 0:
            continue
        seg = y[idx]
        keep.extend(sorted({int(idx[np.argmin(seg)]), int(idx[np.argmax(seg)])}))
    keep_arr = np.array(keep, dtype=int)
    return x[keep_arr], y[keep_arr]


def _set_log(ax: Any, axis: str, values: np.ndarray, notes: list[str]) -> None:
    if np.any(np.isfinite(values) & (values > 0)):
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log", nonpositive="mask")
    else:
        notes.append(f"linear {axis}: no positive values")


#: Most markers drawn for the points of a line at or below 0 on a log y axis (evenly picked; the
#: title gives the full count).
MAX_FLOOR_MARKERS = 500


def _nonpositive(values: np.ndarray) -> np.ndarray:
    return np.asarray(np.isfinite(values) & (values <= 0), dtype=bool)


def _draw_series(fig: Any, spec: dict[str, Any], where: str) -> list[str]:
    notes: list[str] = []
    ys = _labelled(spec, "ys", where, None)
    length = len(next(iter(ys.values())))
    if "x" in spec and spec["x"] is not None:
        x = _vector(spec["x"], f"{where}.x")
    else:
        x = np.arange(length, dtype=np.float64)
    for label, y in ys.items():
        if len(y) != len(x):
            raise PlotSpecError(f"{where}.ys[{label!r}]: has {len(y)} values, expected {len(x)} (the length of x)")
    thresholds = spec.get("thresholds") or {}
    if not isinstance(thresholds, dict):
        raise PlotSpecError(f"{where}.thresholds: expected an object of label -> number")
    lines = {str(k): _number(v, f"{where}.thresholds[{k!r}]") for k, v in thresholds.items()}
    log_x, log_y = _flag(spec, "log_x", where), _flag(spec, "log_y", where)

    ax = fig.add_subplot()
    bad_x: list[np.ndarray] = []
    colours: dict[str, Any] = {}
    for label, y in ys.items():
        xd, yd = _decimate(x, y, MAX_LINE_POINTS)
        (line,) = ax.plot(xd, yd, linewidth=1.2, label=_legend_label(label))
        colours[label] = line.get_color()
        bad_x.append(x[~np.isfinite(y)])
    for label, value in lines.items():
        ax.axhline(value, linestyle="--", linewidth=1.0, color="0.35", label=_legend_label(label))
    floor = 0
    if log_y:
        _set_log(ax, "y", np.concatenate([*ys.values(), np.array(list(lines.values()))]), notes)
        if ax.get_yscale() == "log":
            floor = _floor_markers(ax, x, ys, colours)
            if floor:
                notes.append(f"{floor} point(s) ≤ 0 drawn at the axis floor")
    if log_x:
        _set_log(ax, "x", x, notes)
        dropped = int(np.sum(_nonpositive(x))) * len(ys)
        if ax.get_xscale() == "log" and dropped:
            notes.append(f"{dropped} point(s) at x ≤ 0 not drawn on the log x axis")
    bad = np.concatenate(bad_x)
    if len(bad):
        ax.plot(
            bad,
            np.full(len(bad), 0.97),
            linestyle="none",
            marker="x",
            markersize=5,
            color=_NONFINITE_COLOR,
            transform=ax.get_xaxis_transform(),
            clip_on=False,
            label="non-finite",
        )
        notes.append(f"{len(bad)} non-finite point(s)")
    ax.set_xlabel(_mpl_text(_text(spec, "x_label", where)))
    ax.set_ylabel(_mpl_text(_text(spec, "y_label", where)))
    ax.grid(True, linewidth=0.4, alpha=0.5)
    if len(ys) + len(lines) + bool(len(bad)) + bool(floor) > 1:
        ax.legend(fontsize="small", loc="best")
    return notes


def _floor_markers(ax: Any, x: np.ndarray, ys: dict[str, np.ndarray], colours: dict[str, Any]) -> int:
    """Triangles on the bottom edge of a log y axis where a line is at or below 0 (which the log scale
    cannot place); returns how many points that is."""
    count = 0
    labelled = False
    for label, y in ys.items():
        at = x[_nonpositive(y)]
        count += len(at)
        if not len(at):
            continue
        if len(at) > MAX_FLOOR_MARKERS:
            at = at[np.linspace(0, len(at) - 1, MAX_FLOOR_MARKERS).round().astype(int)]
        ax.plot(
            at,
            np.full(len(at), 0.02),  # axes fraction: just above the bottom edge, wholly inside
            linestyle="none",
            marker="v",
            markersize=4,
            color=colours[label],
            transform=ax.get_xaxis_transform(),
            clip_on=False,
            label=None if labelled else "≤ 0, at the axis floor",
        )
        labelled = True
    return count


def _draw_histogram(fig: Any, spec: dict[str, Any], where: str) -> list[str]:
    notes: list[str] = []
    if "bin_edges" not in spec:
        raise PlotSpecError(f"{where}.bin_edges is missing")
    edges = _vector(spec["bin_edges"], f"{where}.bin_edges", min_len=2)
    if not np.all(np.isfinite(edges)) or np.any(np.diff(edges) <= 0):
        raise PlotSpecError(f"{where}.bin_edges: expected finite, strictly increasing edges")
    counts = _labelled(spec, "counts", where, len(edges) - 1)
    log_x, log_y = _flag(spec, "log_x", where), _flag(spec, "log_y", where)

    ax = fig.add_subplot()
    for label, c in counts.items():
        ax.stairs(np.nan_to_num(c, nan=0.0, posinf=0.0, neginf=0.0), edges, linewidth=1.4, label=_legend_label(label))
    if log_y:
        _set_log(ax, "y", np.concatenate(list(counts.values())), notes)
        empty = sum(int(np.sum(_nonpositive(c))) for c in counts.values())
        if ax.get_yscale() == "log" and empty:
            notes.append(f"{empty} bin(s) of count 0 not drawn on the log y axis")
    if log_x:
        _set_log(ax, "x", edges, notes)
    ax.set_xlabel(_mpl_text(_text(spec, "x_label", where)))
    ax.set_ylabel(_mpl_text(_text(spec, "y_label", where, "count")))
    ax.grid(True, linewidth=0.4, alpha=0.5)
    if len(counts) > 1:
        ax.legend(fontsize="small", loc="best")
    return notes


def _max_pool(z: np.ndarray, side: int) -> np.ndarray:
    """Pool `z` to at most side x side cells, keeping in each block the value of largest magnitude."""
    rows, cols = z.shape
    fr, fc = math.ceil(rows / side), math.ceil(cols / side)
    if fr == 1 and fc == 1:
        return z
    pr, pc = math.ceil(rows / fr) * fr, math.ceil(cols / fc) * fc
    padded = np.full((pr, pc), np.nan)
    padded[:rows, :cols] = z
    blocks = padded.reshape(pr // fr, fr, pc // fc, fc).transpose(0, 2, 1, 3).reshape(pr // fr, pc // fc, fr * fc)
    mag = np.where(np.isnan(blocks), -1.0, np.abs(blocks))
    pick = np.argmax(mag, axis=2)
    return np.take_along_axis(blocks, pick[..., None], axis=2)[..., 0]


def _tick_labels(ax_set_ticks: Any, ax_set_labels: Any, coords: list[Any], pooled: int, n: int) -> None:
    """Label an index axis with the given coordinates at up to 8 evenly spread ticks."""
    count = min(8, pooled)
    positions = np.unique(np.linspace(0, pooled - 1, count).round().astype(int))
    ax_set_ticks(positions)
    labels = []
    for p in positions:
        source = min(n - 1, int(round(p * n / pooled)))
        value = coords[source]
        text = value if isinstance(value, str) else format(value, ".4g") if isinstance(value, float) else str(value)
        labels.append(_mpl_text(text, 12))
    ax_set_labels(labels)


def _draw_heatmap(fig: Any, spec: dict[str, Any], where: str) -> list[str]:
    from matplotlib import colors

    notes: list[str] = []
    if "z" not in spec:
        raise PlotSpecError(f"{where}.z is missing")
    rows = spec["z"]
    if not isinstance(rows, list) or not rows:
        raise PlotSpecError(f"{where}.z: expected a non-empty list of rows")
    z = (
        np.stack([_vector(r, f"{where}.z[{i}]") for i, r in enumerate(rows)])
        if all(isinstance(r, (list, tuple)) and len(r) == len(rows[0]) for r in rows)
        else None
    )
    if z is None:
        for i, r in enumerate(rows):
            _vector(r, f"{where}.z[{i}]")  # names the bad row if it is not a list of numbers
        raise PlotSpecError(f"{where}.z: rows have different lengths (expected a rectangular 2-D list)")
    n_rows, n_cols = z.shape
    coords: dict[str, list[Any] | None] = {}
    for key, n in (("x", n_cols), ("y", n_rows)):
        value = spec.get(key)
        if value is not None and (not isinstance(value, (list, tuple)) or len(value) != n):
            per = "column" if key == "x" else "row"
            raise PlotSpecError(f"{where}.{key}: expected a list of {n} coordinates (one per {per})")
        coords[key] = list(value) if value is not None else None
    log_z = _flag(spec, "log_z", where)

    bad = int(np.sum(~np.isfinite(z)))
    pooled = _max_pool(z, MAX_HEATMAP_SIDE)
    if pooled.shape != z.shape:
        notes.append(f"{n_rows}x{n_cols} max-pooled to {pooled.shape[0]}x{pooled.shape[1]}")
    if bad:
        notes.append(f"{bad} non-finite cell(s) in magenta")
    shown = np.ma.masked_invalid(pooled)
    norm = None
    if log_z:
        positive = shown.compressed()[shown.compressed() > 0]
        if len(positive):
            norm = colors.LogNorm(vmin=float(positive.min()), vmax=float(positive.max()))
        else:
            notes.append("linear colour: no positive values")

    ax = fig.add_subplot()
    cmap = _colormap()
    image = ax.imshow(shown, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest", origin="upper")
    bar = fig.colorbar(image, ax=ax)
    bar.set_label(_mpl_text(_text(spec, "z_label", where)))
    if coords["x"] is not None:
        _tick_labels(ax.set_xticks, ax.set_xticklabels, coords["x"], pooled.shape[1], n_cols)
    if coords["y"] is not None:
        _tick_labels(ax.set_yticks, ax.set_yticklabels, coords["y"], pooled.shape[0], n_rows)
    ax.set_xlabel(_mpl_text(_text(spec, "x_label", where)))
    ax.set_ylabel(_mpl_text(_text(spec, "y_label", where)))
    return notes


def _colormap() -> Any:
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_bad(_BAD_CELL_COLOR)
    return cmap


_DRAW = {
    "series": (_draw_series, _LINE_SIZE),
    "histograms": (_draw_histogram, _LINE_SIZE),
    "heatmaps": (_draw_heatmap, _HEATMAP_SIZE),
}

_SVG_ROOT = re.compile(r"<svg\b[^>]*>", re.S)
_svg_cache: OrderedDict[str, str] = OrderedDict()


def _digest(kind: str, spec: Any) -> str:
    canonical = json.dumps([kind, spec], sort_keys=True, default=str, allow_nan=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def render_plot_svg(plot: Plot) -> str:
    """The plot as an inline ``<svg>`` element (no XML prologue, scales to its container).

    Raises `PlotSpecError` when the description breaks the conventions in the module docstring.
    """
    if plot.kind not in _DRAW:
        raise PlotSpecError(f"{plot.where}: unknown plot kind {plot.kind!r}; expected one of {', '.join(PLOT_KINDS)}")
    if not isinstance(plot.spec, dict):
        raise PlotSpecError(f"{plot.where}: expected an object, got {type(plot.spec).__name__}")
    key = _digest(plot.kind, plot.spec)
    cached = _svg_cache.get(key)
    if cached is not None:
        _svg_cache.move_to_end(key)
        return cached
    svg = _render_svg(plot, salt=key)
    _svg_cache[key] = svg
    while len(_svg_cache) > _CACHE_SIZE:
        _svg_cache.popitem(last=False)
    return svg


_SVG_ID = re.compile(r'\bid="([^"]+)"')
_SVG_REF = re.compile(r'(url\(#|href="#)([^")]+)')


def prefix_svg_ids(svg: str, prefix: str) -> str:
    """`svg` with every element id and every internal reference to one (``url(#id)``, ``href="#id"``)
    prefixed, so that several plots inline in one page never share an id."""
    svg = _SVG_ID.sub(lambda m: f'id="{prefix}{m.group(1)}"', svg)
    return _SVG_REF.sub(lambda m: f"{m.group(1)}{prefix}{m.group(2)}", svg)


def _render_svg(plot: Plot, *, salt: str) -> str:
    import matplotlib
    from matplotlib.figure import Figure

    draw, size = _DRAW[plot.kind]
    where = plot.where
    spec = plot.spec
    title = _text(spec, "title", where)
    style = {
        "svg.fonttype": "none",  # real <text>: small, selectable, searchable in the page
        "svg.hashsalt": salt,  # ids stable per description (the page prefixes them per figure)
        "font.size": 9,
        "font.family": ["DejaVu Sans", "sans-serif"],
    }
    with matplotlib.rc_context(style), warnings.catch_warnings():  # type: ignore[arg-type]  # rc keys typed as literals
        warnings.simplefilter("ignore")
        fig = Figure(figsize=size, layout="constrained")
        notes = draw(fig, spec, where)
        heading = _mpl_text(title) if title else ""
        if notes:
            heading = (heading + "\n" if heading else "") + "(" + "; ".join(notes) + ")"
        if heading:
            fig.axes[0].set_title(heading, fontsize=10)
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    svg = buffer.getvalue()
    start = svg.find("<svg")
    if start < 0:  # pragma: no cover - matplotlib always writes an <svg> root
        raise RuntimeError("matplotlib produced no <svg> element")
    svg = re.sub(r"\s*<metadata>.*?</metadata>", "", svg[start:], count=1, flags=re.S)

    def root(match: re.Match[str]) -> str:
        tag = re.sub(r'\s(width|height)="[^"]*"', "", match.group(0))
        return tag[:-1] + ' class="plot" role="img" preserveAspectRatio="xMidYMid meet">'

    return _SVG_ROOT.sub(root, svg, count=1).strip()
