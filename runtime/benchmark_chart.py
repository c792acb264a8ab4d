"""The benchmark's chart: a bar chart with matplotlib when it is importable, else a text table
drawn with Pillow (ComfyUI always has Pillow). Never imports ComfyUI.

Both return an RGB uint8 array [H, W, 3]; the node turns it into ComfyUI's IMAGE
([1, H, W, 3] float in 0..1) and `png_bytes` into the file the UI shows.
"""
from __future__ import annotations

import io
import logging
import math
from typing import Optional

import numpy as np

from .benchmark_core import TABLE_HEADER, TABLE_LEFT, header_lines, table_rows, within_bar

log = logging.getLogger("triton_accel.benchmark")

PYTORCH_COLOR = "#8c8c8c"
OURS_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e")


def chart_backend() -> str:
    """"matplotlib", "pillow" or "none": what draw_chart will use here."""
    try:
        import matplotlib  # noqa: F401

        return "matplotlib"
    except Exception:
        pass
    try:
        import PIL  # noqa: F401

        return "pillow"
    except Exception:
        return "none"


def draw_chart(result: dict, backend: Optional[str] = None) -> Optional[np.ndarray]:
    """The chart of a benchmark result as RGB uint8 [H, W, 3], or None when neither matplotlib
    nor Pillow is importable (the result's text still says everything)."""
    backend = backend or chart_backend()
    if backend == "matplotlib":
        try:
            return _matplotlib_chart(result)
        except Exception:  # a broken matplotlib install: the table still shows the numbers
            log.warning("Triton Accel benchmark: matplotlib chart failed; drawing the text table", exc_info=True)
            backend = "pillow"
    if backend == "pillow":
        return _table_image(result)
    return None


def png_bytes(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _value(r: dict, metric: str) -> float:
    v = r.get(metric)
    return 0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _bar_note(row: dict, r: dict) -> str:
    if r["error"]:
        return r["error"].split(":")[0][:30]
    base = row["results"][0]["ms"]
    parts = []
    if r["impl"] != "pytorch" and base and r["ms"]:
        parts.append(f"{base / r['ms']:.2f}x")
    if r["rel_l2"] is not None:
        bad = not within_bar(row, r)
        parts.append(f"L2 {r['rel_l2']:.1e}" + (" (too far)" if bad else ""))
    return "  ".join(parts)


MAX_CHART_ROWS = 24  # per kind; the rest (the smallest shares of the forward) stay in the text


def _top_rows(rows: list) -> list:
    """The rows that take the most time per forward (count x PyTorch's ms), in the result's order."""
    if len(rows) <= MAX_CHART_ROWS:
        return rows
    share = sorted(rows, key=lambda r: -(r["count"] * (r["results"][0]["ms"] or 0.0)))[:MAX_CHART_ROWS]
    return [r for r in rows if any(r is s for s in share)]


def _matplotlib_chart(result: dict) -> np.ndarray:
    # The object API with its own Agg canvas: no pyplot, no global backend switch inside ComfyUI.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = {k: _top_rows(result[k]) for k in ("attention", "linear") if result.get(k)}
    kinds = list(shown)
    metric = "tflops" if any(r["flops"] for k in kinds for r in shown[k]) else "ms"
    heights = [len(shown[k]) * (len(shown[k][0]["results"]) * 0.28 + 0.35) + 0.8 for k in kinds] or [1.5]
    fig = Figure(figsize=(11, sum(heights) + 1.2), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(kinds) or 1, 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, kind in zip(axes, kinds):
        _bars(ax, shown[kind], kind, metric, len(result[kind]) - len(shown[kind]))
    if not kinds:
        axes[0].text(0.5, 0.5, "no attention or Linear calls recorded", ha="center", va="center")
        axes[0].set_axis_off()
    summary = result.get("summary", {}).get("both", {})
    title = f"Triton Accel on {result['device_name']}"
    if summary.get("speedup"):
        title += f": attention + Linear {summary['speedup']:.2f}x faster than PyTorch (per forward)"
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[:, :, :3].copy()


def _bars(ax, rows: list, kind: str, metric: str, hidden: int) -> None:
    impls = []
    for row in rows:
        for r in row["results"]:
            if r["impl"] not in impls:
                impls.append(r["impl"])
    height = 0.8 / len(impls)
    top = max([_value(r, metric) for row in rows for r in row["results"]] + [1e-9])
    for j, impl in enumerate(impls):
        color = PYTORCH_COLOR if j == 0 else OURS_COLORS[(j - 1) % len(OURS_COLORS)]
        label = next(r["label"] for row in rows for r in row["results"] if r["impl"] == impl)
        for i, row in enumerate(rows):
            r = next((x for x in row["results"] if x["impl"] == impl), None)
            if r is None:
                continue
            y = i + (j - (len(impls) - 1) / 2) * height
            value = _value(r, metric)
            rel = r.get("rel_l2")
            off = rel is not None and not within_bar(row, r)  # NaN too: hatched, not counted
            ax.barh(y, value, height=height * 0.9, color=color, label=label if i == 0 else None,
                    hatch="//" if off else None, alpha=0.5 if off else 1.0)
            ax.text(value + top * 0.01, y, _bar_note(row, r), va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{row['label']}  (x{row['count']})" for row in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, top * 1.4)
    ax.set_xlabel("TFLOP/s (higher is faster)" if metric == "tflops" else "ms (lower is faster)")
    more = f"; {hidden} smaller shapes in the report" if hidden else ""
    ax.set_title(f"{kind}: per recorded shape (calls per forward){more}", fontsize=10, loc="left")
    ax.legend(fontsize=8, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(impls), frameon=False)


def _table_image(result: dict) -> np.ndarray:
    """The report as a table drawn cell by cell (columns line up with any font, proportional
    ones included), with a bar per shape for our best accurate speed-up: green faster, red slower."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))

    def width(text: str) -> float:
        return probe.textlength(text, font=font)

    head = header_lines(result)
    rows = table_rows(result)
    gap, pad, bar_w = 14, 12, 160
    cols = [max([width(TABLE_HEADER[j])] + [width(cells[j]) for cells, error, _ in rows if not (error and j > 4)])
            for j in range(len(TABLE_HEADER))]
    xs = [pad]
    for w in cols[:-1]:
        xs.append(xs[-1] + w + gap)
    bar_x = xs[-1] + cols[-1] + 2 * gap
    errors = [xs[4] + width(cells[4]) for cells, error, _ in rows if error]
    line_h = max(12, probe.textbbox((0, 0), "Ag", font=font)[3] + 5)
    right = [bar_x + bar_w + 60, bar_x + width("best of ours vs PyTorch")] + [pad + width(t) for t in head] + errors
    total_w = max(right) + pad
    total_h = pad * 2 + line_h * (len(head) + 2 + len(rows))
    img = Image.new("RGB", (int(total_w), int(total_h)), "white")
    draw = ImageDraw.Draw(img)
    y = pad
    for text in head:
        draw.text((pad, y), text, fill="black", font=font)
        y += line_h
    y += line_h
    for cells, error, speedup in [(TABLE_HEADER, False, None)] + rows:
        for j, cell in enumerate(cells):
            if TABLE_LEFT[j] or (error and j == 4):
                draw.text((xs[j], y), cell, fill="#b00000" if error and j == 4 else "black", font=font)
            else:
                draw.text((xs[j] + cols[j] - width(cell), y), cell, fill="black", font=font)
        if cells is TABLE_HEADER:
            draw.text((bar_x, y), "best of ours vs PyTorch", fill="black", font=font)
        if speedup:
            length = int(min(2.0, speedup) / 2.0 * bar_w)
            color = "#2ca02c" if speedup >= 1 else "#d62728"
            draw.rectangle([bar_x, y + 2, bar_x + length, y + line_h - 4], fill=color)
            draw.line([bar_x + bar_w // 2, y, bar_x + bar_w // 2, y + line_h - 2], fill="black")  # the 1.0x mark
            draw.text((bar_x + max(length, bar_w // 2) + 4, y), f"{speedup:.2f}x", fill="black", font=font)
        y += line_h
    return np.asarray(img, dtype=np.uint8).copy()
