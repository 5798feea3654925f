"""The report's figures: a matplotlib Figure on an Agg canvas (no pyplot, no global backend switch),
embedded as a base64 PNG data URI."""

from __future__ import annotations

import base64
import io

COLORS = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def new_figure(width: float, height: float, constrained: bool = True):
    # deferred: matplotlib is heavy; only reports with plots need it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # deferred: matplotlib is heavy; only reports with plots need it

    # Constrained layout costs ~0.4 s per grid of small plots; grids place themselves by hand.
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained" if constrained else None)
    FigureCanvasAgg(fig)
    return fig


def png_data_uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
