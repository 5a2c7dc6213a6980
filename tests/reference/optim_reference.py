"""Reference values for tests/unit/optim_test.cc, computed with PyTorch in float64.

Usage: optim_reference.py REQUEST.json
The request is {"cases": [case, ...]}; the script prints {"<case id>": result, ...} as JSON.
Case kinds:
  optim:    {"kind": "optim", "optimizer": "sgd"|"adam"|"adamw"|"adagrad",
             "kwargs": {option: value} (dtrain OptimizerOptions field names; beta1/beta2
             become betas), "shapes": [[...], ...], "params": [[flat values], ...],
             "grads": [[[flat values] or null per param] per step]}
            -> {"params": [[[flat values] per param] after each step],
                "steps": [state step per param after the last step (0: no state)]}
            torch.optim.<Name>(..., foreach=False): the single-tensor formulas. A null grad
            leaves .grad None for that step, so torch skips the parameter.
  schedule: {"kind": "schedule", "name": "cosine"|"linear", "warmup": W, "total": T,
             "min_lr_ratio": m, "steps": N}
            -> [lr factor for step 0..N-1], from torch.optim.lr_scheduler: LinearLR warm-up
            (1/W -> 1 over W - 1 steps) then CosineAnnealingLR / LinearLR, by SequentialLR.
  clip:     {"kind": "clip", "grads": [[flat values] or null], "max_norm": x}
            -> {"norm": total norm, "grads": [[flat values] or null]} from
            torch.nn.utils.clip_grad_norm_.
"""
import json
import sys

import torch

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
              "adagrad": torch.optim.Adagrad}


def tensor(values, shape=None):
    t = torch.tensor(values, dtype=torch.float64)
    return t.reshape(shape) if shape is not None else t


def run_optim(case):
    params = [tensor(v, s).requires_grad_() for v, s in zip(case["params"], case["shapes"])]
    kwargs = dict(case["kwargs"])
    if "beta1" in kwargs or "beta2" in kwargs:
        kwargs["betas"] = (kwargs.pop("beta1", 0.9), kwargs.pop("beta2", 0.999))
    optimizer = OPTIMIZERS[case["optimizer"]](params, foreach=False, **kwargs)
    history = []
    for step_grads in case["grads"]:
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else tensor(g, p.shape)
        optimizer.step()
        history.append([p.detach().reshape(-1).tolist() for p in params])
    steps = []
    for p in params:
        state = optimizer.state.get(p, {})
        # SGD keeps no step count: count the updates from the grads given.
        steps.append(float(state["step"]) if "step" in state else None)
    return {"params": history, "steps": steps}


def run_schedule(case):
    warmup, total, floor = case["warmup"], case["total"], case["min_lr_ratio"]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = torch.optim.lr_scheduler
    if case["name"] == "cosine":
        decay = sched.CosineAnnealingLR(optimizer, T_max=total - warmup, eta_min=floor)
    else:
        decay = sched.LinearLR(optimizer, start_factor=1.0, end_factor=floor,
                               total_iters=total - warmup)
    warm = sched.LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0,
                          total_iters=warmup - 1)
    schedule = sched.SequentialLR(optimizer, [warm, decay], milestones=[warmup])
    factors = []
    for _ in range(case["steps"]):
        factors.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return factors


def run_clip(case):
    grads = [None if g is None else tensor(g) for g in case["grads"]]
    params = []
    for g in grads:
        p = torch.zeros(1 if g is None else g.numel(), dtype=torch.float64, requires_grad=True)
        p.grad = g
        params.append(p)
    norm = torch.nn.utils.clip_grad_norm_(params, case["max_norm"], foreach=False)
    return {"norm": float(norm),
            "grads": [None if p.grad is None else p.grad.tolist() for p in params]}


def main():
    with open(sys.argv[1]) as f:
        request = json.load(f)
    runners = {"optim": run_optim, "schedule": run_schedule, "clip": run_clip}
    results = {case["id"]: runners[case["kind"]](case) for case in request["cases"]}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
