"""The one style registry of every figure, and the paper style (`testbed plot --style paper`).

`STYLE` maps each policy to its label, colour, marker and line style. The colours are the
Okabe-Ito palette (safe for the common colour-vision deficiencies), and each policy also has its
own marker and dash pattern, so a figure printed in greyscale still tells the lines apart.

`paper(width)` is a context of matplotlib settings for figures that go into a paper:
- vector PDF with TrueType fonts embedded (`pdf.fonttype` 42; matplotlib's default, 3, writes
  Type 3 fonts, which publishers reject);
- 8 pt text, the size of a two-column paper's captions;
- `SINGLE_IN` (3.3 in) or `DOUBLE_IN` (7 in) wide.
"""

from __future__ import annotations

import contextlib

SINGLE_IN = 3.3         # one column of a two-column paper
DOUBLE_IN = 7.0         # the full text width
WIDTHS = {"single": SINGLE_IN, "double": DOUBLE_IN}

STYLE = {
    "homogeneous": {"label": "Homogeneous PD", "color": "#0072B2", "marker": "o",
                    "linestyle": "-"},
    "naive": {"label": "Naive heterogeneous", "color": "#E69F00", "marker": "s",
              "linestyle": "--"},
    "prfaas": {"label": "PrfaaS-PD", "color": "#009E73", "marker": "^", "linestyle": "-."},
}
FALLBACK = ("#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
FALLBACK_MARKERS = ("D", "v", "P", "X", "*")
FALLBACK_LINES = (":", (0, (5, 1)), (0, (3, 1, 1, 1)), (0, (1, 1)), "-")

PAPER_RC = {
    "pdf.fonttype": 42, "ps.fonttype": 42,
    "font.family": "DejaVu Sans", "font.size": 8, "axes.labelsize": 8, "axes.titlesize": 8,
    "legend.fontsize": 7, "xtick.labelsize": 7, "ytick.labelsize": 7,
    "lines.linewidth": 1.2, "lines.markersize": 4, "axes.linewidth": 0.6,
    "grid.linewidth": 0.4, "savefig.bbox": "tight", "savefig.pad_inches": 0.02,
}


def style_of(policy: str | None, index: int = 0) -> dict:
    """The registry entry of a policy; an unknown one gets the next fallback, by `index`."""
    if policy in STYLE:
        return STYLE[policy]
    i = index % len(FALLBACK)
    return {"label": policy or "?", "color": FALLBACK[i], "marker": FALLBACK_MARKERS[i],
            "linestyle": FALLBACK_LINES[i]}


@contextlib.contextmanager
def paper():
    """matplotlib settings for paper figures (module docstring), restored afterwards."""
    import matplotlib   # heavy: only where figures are drawn
    with matplotlib.rc_context(PAPER_RC):
        yield
