"""Reads a Hugging Face checkpoint directory as transformers does, for tests/unit/hf_checkpoint_test.cc.

Usage: hf_checkpoint_reference.py DIR
Reads DIR/model.safetensors, or the files DIR/model.safetensors.index.json's weight_map names
(checking that every tensor is in the file the index says), with the safetensors package, and
prints {"files": [file names], "tensors": {name: {"dtype": str, "shape": [...],
"values": [flat values as float64]}}, "config": config.json's object or null} as JSON.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file


def main():
    d = sys.argv[1]
    single = os.path.join(d, "model.safetensors")
    index_path = os.path.join(d, "model.safetensors.index.json")
    tensors = {}
    if os.path.exists(single):
        files = ["model.safetensors"]
        tensors = load_file(single)
    else:
        with open(index_path) as f:
            index = json.load(f)
        files = sorted(set(index["weight_map"].values()))
        for name in files:
            part = load_file(os.path.join(d, name))
            for key in part:
                assert index["weight_map"][key] == name, (key, name)
            tensors.update(part)
        assert set(tensors) == set(index["weight_map"]), "index and files disagree"
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert index["metadata"]["total_size"] == size, (index["metadata"]["total_size"], size)
    config = None
    if os.path.exists(os.path.join(d, "config.json")):
        with open(os.path.join(d, "config.json")) as f:
            config = json.load(f)
    out = {"files": files, "config": config, "tensors": {
        k: {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape),
            "values": v.to(torch.float64).flatten().tolist()} for k, v in tensors.items()}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
