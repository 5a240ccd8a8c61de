#!/usr/bin/env python3
"""Bar chart of `flamia bench attention --json-out FILE`: per workload, the speedup of each
training call over cuDNN BF16's forward + backward (higher is faster)."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    with open(src) as f:
        tables = json.load(f)["tables"]
    summary = tables[0]
    col = {name: i for i, name in enumerate(summary["columns"])}

    def number(row, name):
        try:
            return float(row[col[name]])
        except (KeyError, ValueError):
            return None  # "unsupported", "not built"

    series = [("cuDNN FP8 call, fresh scales", "FP8 call fresh"),
              ("cuDNN FP8 call, calibrated scales", "FP8 call calib"),
              ("flamia training call", "flamia call")]
    workloads = [r[col["workload"]] for r in summary["rows"]]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(series)
    for k, (label, name) in enumerate(series):
        xs, ys = [], []
        for i, row in enumerate(summary["rows"]):
            base, t = number(row, "BF16 fwd+bwd"), number(row, name)
            if base and t:
                xs.append(i + (k - (len(series) - 1) / 2) * width)
                ys.append(base / t)
        if ys:
            ax.bar(xs, ys, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=20)
    ax.set_ylabel("speedup over cuDNN BF16 fwd+bwd")
    ax.set_title(summary["notes"][0] if summary["notes"] else "flamia bench")
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_bench.py BENCH.json OUT.png")
    main(sys.argv[1], sys.argv[2])
