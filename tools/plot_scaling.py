#!/usr/bin/env python3
"""Draws dtrain-plan --simulate --search --scaling_nodes=... output as a PNG: the best layout's
predicted throughput (tokens/s, the whole cluster's) against the node count, beside perfect
linear scaling from the smallest count, each point labelled with its layout and MFU.

usage: dtrain-plan --simulate --search --scaling_nodes=1,2,4,8 ... | plot_scaling.py OUT.png [--title T]
       plot_scaling.py OUT.png --input FILE   (the JSON lines dtrain-plan printed)
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--input", default="-")
    ap.add_argument("--title", default="predicted throughput of the best layout")
    args = ap.parse_args()
    text = sys.stdin.read() if args.input == "-" else open(args.input).read()
    rows = [json.loads(l) for l in text.splitlines() if l.startswith("{") and '"nodes"' in l]
    if not rows:
        sys.exit("plot_scaling.py: no JSON lines with \"nodes\" in the input; give it the output of "
                 "dtrain-plan --simulate --search --scaling_nodes=...")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_scaling.py: matplotlib is missing; run cluster/setup.sh (it installs it into .venv) "
                 "and use .venv/bin/python")
    rows.sort(key=lambda r: r["nodes"])
    nodes = [r["nodes"] for r in rows]
    tps = [r["tokens_per_s"] for r in rows]
    ideal = [tps[0] * n / nodes[0] for n in nodes]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(nodes, ideal, "--", color="gray", label="linear from %d node%s" % (nodes[0], "s" if nodes[0] > 1 else ""))
    ax.plot(nodes, tps, "o-", label="best layout (predicted)")
    for n, t, r in zip(nodes, tps, rows):
        ax.annotate("%s\nMFU %.0f%%" % (r["layout"].replace(" cp 1", "").replace(" zero 0", ""), 100 * r["mfu"]),
                    (n, t), textcoords="offset points", xytext=(4, -22), fontsize=6)
    ax.set_xscale("log", base=2)
    ax.set_xlim(nodes[0] / 1.4, nodes[-1] * 2.5)  # room for the labels
    ax.set_yscale("log")
    ax.set_xlabel("nodes")
    ax.set_ylabel("tokens/s (cluster)")
    ax.set_title(args.title, fontsize=10)
    ax.legend(loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print("plot_scaling.py: wrote %s (%d node counts)" % (args.out, len(rows)))


if __name__ == "__main__":
    main()
