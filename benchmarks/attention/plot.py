"""Bar chart of a benchmark run: fwd+bwd TFLOP/s per case, deterministic and non-deterministic.

``python benchmarks/attention/plot.py benchmarks/results/attention.json`` redraws the PNG beside
the JSON. Needs matplotlib (present on the GPU machine); without it, says so and draws nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Fixed colours so that the same implementation looks the same in every run.
_COLOURS = {
    "te_dpa_det": "#08306b", "te_fused_det": "#2171b5", "jax_te_det": "#9ecae1",
    "te_dpa": "#08306b", "te_fused": "#2171b5", "jax_te": "#9ecae1",
    "fa4_det": "#d94801", "fa4": "#d94801",
    "cudnn_fe_det": "#238b45", "cudnn_fe": "#238b45", "torch_cudnn": "#74c476",
    "torch_flash_det": "#756bb1", "torch_flash": "#756bb1",
    "jax_cudnn_det": "#a1d99b", "jax_cudnn": "#a1d99b", "jax_xla": "#969696",
}


def plot(rows, cases, path, title="Attention benchmark"):
    """Write ``path`` (PNG); returns a one-line message (also when matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed: no plot ({path} not written)"
    ok = [r for r in rows if r.get("status") == "ok" and r.get("fwd_bwd_tflops") is not None]
    names = [c["name"] for c in cases if any(r["case"] == c["name"] for r in ok)]
    if not names:
        return "no measured rows: no plot"
    labels = {c["name"]: c.get("label", c["name"]) for c in cases}
    panels = [("deterministic", [r for r in ok if r.get("deterministic")]),
              ("non-deterministic", [r for r in ok if not r.get("deterministic")])]
    panels = [(t, rs) for t, rs in panels if rs]
    size = (max(12, 1.6 * len(names) + 3.5), 4.2 * len(panels))
    fig, axes = plt.subplots(len(panels), 1, figsize=size, squeeze=False)
    for ax, (kind, rs) in zip(axes[:, 0], panels):
        impls = []
        for r in rs:
            if r["impl"] not in impls:
                impls.append(r["impl"])
        width = 0.8 / len(impls)
        value = {(r["case"], r["impl"]): r["fwd_bwd_tflops"] for r in rs}
        label_of = {r["impl"]: r.get("label", r["impl"]) for r in rs}
        for j, impl in enumerate(impls):
            xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(names))]
            ys = [value.get((n, impl), 0) for n in names]
            ours = impl.startswith(("te_", "jax_te"))
            ax.bar(xs, ys, width, label=label_of[impl], color=_COLOURS.get(impl, "#bdbdbd"),
                   edgecolor="black" if ours else "none", linewidth=0.8, hatch="//" if impl.startswith("jax") else None)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([labels[n] for n in names], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("fwd+bwd TFLOP/s")
        ax.set_title(f"{title}: {kind}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def main(argv):
    if len(argv) != 1:
        print(__doc__)
        return 2
    src = Path(argv[0])
    doc = json.loads(src.read_text())
    print(plot(doc["rows"], doc["cases"], str(src.with_suffix(".png"))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
