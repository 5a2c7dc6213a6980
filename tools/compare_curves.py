#!/usr/bin/env python3
"""Compares the curves tools/record_curves.sh wrote in two directories, field by field.

usage: compare_curves.py BEFORE_DIR AFTER_DIR
Prints, per run, whether loss / grad_norm / loss_scale / eval_loss are bit-identical and the
largest relative difference otherwise. Exits 1 when a run differs by more than 1e-6 relative.
"""
import json
import os
import sys

FIELDS = ("loss", "grad_norm", "loss_scale", "eval_loss")


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(before, after):
    bad = False
    for name in sorted(os.listdir(before)):
        if not name.endswith(".jsonl"):
            continue
        other = os.path.join(after, name)
        if not os.path.exists(other):
            print(f"{name}: missing in {after}")
            bad = True
            continue
        a, b = load(os.path.join(before, name)), load(other)
        if len(a) != len(b):
            print(f"{name}: {len(a)} vs {len(b)} lines")
            bad = True
            continue
        parts = []
        for field in FIELDS:
            pairs = [(x[field], y.get(field)) for x, y in zip(a, b) if field in x]
            if not pairs:
                continue
            worst = max(abs(x - y) / max(abs(x), 1e-30) for x, y in pairs)
            parts.append(f"{field} " + ("identical" if worst == 0 else f"max rel diff {worst:.2e}"))
            bad = bad or worst > 1e-6
        print(f"{name[:-6]}: " + ", ".join(parts))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
