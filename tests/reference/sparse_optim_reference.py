"""Reference values for tests/unit/sparse_reference_test.cc: torch.optim's own optimizers on
sparse (COO) gradients, in float64.

Usage: sparse_optim_reference.py REQUEST.json
The request is {"cases": [{"id": str, "optimizer": "sparse_adam"|"adagrad"|"sgd",
"kwargs": {...torch keyword arguments...}, "shape": [V, d], "param": [flat values],
"steps": [{"rows": [int, ...], "values": [flat values, len(rows) * d]}, ...]}]}.
Prints {"<id>": [[flat param] after each step], ...} as JSON.
"""
import json
import sys

import torch

OPTIMIZERS = {"sparse_adam": torch.optim.SparseAdam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}


def main():
    request = json.load(open(sys.argv[1]))
    out = {}
    for case in request["cases"]:
        shape = case["shape"]
        p = torch.tensor(case["param"], dtype=torch.float64).reshape(shape).requires_grad_()
        opt = OPTIMIZERS[case["optimizer"]]([p], **case["kwargs"])
        after = []
        for step in case["steps"]:
            rows = torch.tensor(step["rows"], dtype=torch.long)
            values = torch.tensor(step["values"], dtype=torch.float64).reshape(len(step["rows"]), *shape[1:])
            p.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, shape)
            opt.step()
            after.append(p.detach().reshape(-1).tolist())
        out[case["id"]] = after
    print(json.dumps(out))


if __name__ == "__main__":
    main()
