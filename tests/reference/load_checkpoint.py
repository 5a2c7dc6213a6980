"""Reads a dtrain checkpoint with PyTorch alone, as a user would, and prints JSON.

usage: load_checkpoint.py CHECKPOINT.pt [MODEL]

Loads the file with torch.load(weights_only=True) (no dtrain code involved) and prints
  keys      the top-level entries of the file
  step, meta, world_size, dp_size, rank_files
  entries   for each "model" entry in file order: name, shape, dtype, float64 sum
When MODEL is given ("mlp_bn": the model tests/unit/checkpoint_test.cc builds), also builds
the equivalent torch.nn.Module, loads ckpt["model"] with load_state_dict(strict=True) and prints
  module_names  the module's own state_dict() names, in its order
  output        the module's eval-mode output on a fixed input, flattened (float64)
"""
import json
import sys

import torch
from torch import nn


class MlpBn(nn.Module):
    """body: Linear(4, 8), BatchNorm1d(8), ReLU, Linear(8, 3); head: Linear(3, 2)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.body(x))


MODELS = {"mlp_bn": MlpBn}


def fixed_input():
    return torch.linspace(-2.0, 2.0, 5 * 4, dtype=torch.float32).reshape(5, 4)


def main():
    path = sys.argv[1]
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    out = {
        "keys": sorted(ckpt.keys()),
        "step": ckpt["step"],
        "meta": ckpt["meta"],
        "world_size": ckpt["world_size"],
        "dp_size": ckpt["dp_size"],
        "rank_files": ckpt["rank_files"],
        "entries": [
            {"name": name, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
             "sum": float(t.double().sum())}
            for name, t in ckpt["model"].items()
        ],
    }
    if len(sys.argv) > 2:
        module = MODELS[sys.argv[2]]()
        module.load_state_dict(ckpt["model"], strict=True)
        module.eval()
        with torch.no_grad():
            y = module(fixed_input())
        out["module_names"] = list(module.state_dict().keys())
        out["output"] = [float(v) for v in y.double().flatten()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
