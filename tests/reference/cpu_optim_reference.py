"""Reference values for tests/unit/offload_cpu_optim_test.cc: torch.optim in float64.

Usage: cpu_optim_reference.py DIR
DIR/request.json is {"cases": [case, ...]}, each case
  {"id": name, "optimizer": "sgd"|"adam"|"adamw"|"adagrad",
   "kwargs": {option: value} (CpuOptimizerOptions field names; beta1/beta2 become betas),
   "sizes": [numel of each parameter],
   "params": "file" (the start values, float32 little-endian, parameters concatenated),
   "grads": ["file", ...] (one float32 file per step, same layout),
   "out": "file"}
Files are relative to DIR. Inputs are float32 because every value the test uses is exactly a
float32 (bf16/fp16 gradients are too); the reference itself runs in float64:
torch.optim.<Name>(..., foreach=False), every parameter with a gradient at every step.
For each case the script writes to "out" float64 arrays, each the parameters concatenated:
the weights after the last step, then the state of the optimizer in this order:
  adam/adamw: exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad); adagrad: sum;
  sgd with momentum: momentum_buffer; sgd without: nothing more.
It prints {"<id>": ["params", <state names>...]} as JSON.
"""
import json
import os
import sys

import numpy as np
import torch

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
              "adagrad": torch.optim.Adagrad}


def load(directory, name):
    data = np.fromfile(os.path.join(directory, name), dtype="<f4")
    return torch.from_numpy(data.astype(np.float64))


def split(flat, sizes):
    return list(torch.split(flat, sizes))


def state_names(case):
    kind, kwargs = case["optimizer"], case["kwargs"]
    if kind in ("adam", "adamw"):
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if kwargs.get("amsgrad") else [])
    if kind == "adagrad":
        return ["sum"]
    return ["momentum_buffer"] if kwargs.get("momentum", 0.0) != 0.0 else []


def run(directory, case):
    sizes = case["sizes"]
    params = [p.clone().requires_grad_() for p in split(load(directory, case["params"]), sizes)]
    kwargs = dict(case["kwargs"])
    if "beta1" in kwargs or "beta2" in kwargs:
        kwargs["betas"] = (kwargs.pop("beta1", 0.9), kwargs.pop("beta2", 0.999))
    optimizer = OPTIMIZERS[case["optimizer"]](params, foreach=False, **kwargs)
    for grad_file in case["grads"]:
        for p, g in zip(params, split(load(directory, grad_file), sizes)):
            p.grad = g.clone()
        optimizer.step()
    names = state_names(case)
    arrays = [torch.cat([p.detach() for p in params])]
    for name in names:
        arrays.append(torch.cat([optimizer.state[p][name].reshape(-1) for p in params]))
    torch.cat(arrays).numpy().astype("<f8").tofile(os.path.join(directory, case["out"]))
    return ["params"] + names


def main():
    directory = sys.argv[1]
    with open(os.path.join(directory, "request.json")) as f:
        request = json.load(f)
    result = {case["id"]: run(directory, case) for case in request["cases"]}
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
