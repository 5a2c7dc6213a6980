"""Renders a dtrain timeline (Chrome trace JSON, one file or merged) as a PNG, one row per
rank and lane, as chrome://tracing would show it. Used for docs/images/timeline.png.

usage: render_timeline.py TRACE.json OUT.png [--steps FIRST LAST]
  --steps: show only steps FIRST..LAST (1-based, by the "step" events of rank 0)
Needs matplotlib (not a dtrain dependency).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "copy": "#55A868", "data": "#8172B3",
          "optimizer": "#C44E52"}
LANE_ORDER = ["main", "loader", "copy", "backward", "comm", "optimizer"]


def load(path):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    lanes = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            lanes[(e["pid"], e["tid"])] = e["args"]["name"]
    out = []
    for e in events:
        if e.get("ph") in ("X", "i"):
            e = dict(e)
            e["lane"] = lanes.get((e["pid"], e["tid"]), "tid %d" % e["tid"])
            out.append(e)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--steps", nargs=2, type=int)
    args = ap.parse_args()
    events = load(args.trace)
    if args.steps:
        steps = sorted((e for e in events if e["name"] == "step" and e["pid"] == 0),
                       key=lambda e: e["ts"])
        first, last = steps[args.steps[0] - 1], steps[args.steps[1] - 1]
        lo, hi = first["ts"] - 500, last["ts"] + last["dur"] + 500
        events = [e for e in events if e["ts"] < hi and e["ts"] + e.get("dur", 0) > lo]
    else:
        lo = min(e["ts"] for e in events)
        hi = max(e["ts"] + e.get("dur", 0) for e in events)

    def lane_key(row):
        rank, lane = row
        return (rank, LANE_ORDER.index(lane) if lane in LANE_ORDER else 99, lane)

    rows = sorted({(e["pid"], e["lane"]) for e in events}, key=lane_key)
    y = {row: i for i, row in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(11, 0.36 * len(rows) + 1.2))
    for e in events:
        row = y[(e["pid"], e["lane"])]
        start = (e["ts"] - lo) / 1000.0
        color = COLORS.get(e.get("cat"), "#999999")
        if e["ph"] == "X":
            # "step" encloses the row's other events: draw it as a thin outline.
            if e["name"] == "step":
                ax.barh(row, e["dur"] / 1000.0, left=start, height=0.9, fill=False,
                        edgecolor="#888888", linewidth=0.8)
                continue
            ax.barh(row, e["dur"] / 1000.0, left=start, height=0.6, color=color,
                    edgecolor="white", linewidth=0.3)
            # Label a bar when its name fits (about 5.5 px a character over ~940 px of plot).
            if len(e["name"]) * 5.5 < e["dur"] / (hi - lo) * 940:
                ax.text(start + e["dur"] / 2000.0, row, e["name"], ha="center", va="center",
                        fontsize=7, color="white", clip_on=True)
        else:
            ax.plot([start], [row - 0.38], marker="v", markersize=4, color=color)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["rank %d  %s" % row for row in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, (hi - lo) / 1000.0)
    ax.set_xlabel("ms", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, COLORS.keys(), loc="lower center", bbox_to_anchor=(0.5, 1.0),
              ncol=len(COLORS), fontsize=8, frameon=False)
    ax.grid(axis="x", color="#eeeeee")
    ax.set_axisbelow(True)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
