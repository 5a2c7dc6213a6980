#!/usr/bin/env python3
"""A diverging run stops and leaves only finite checkpoints (run-level safety).

train_mlp with --lr=1e12 and --save_every=1 (it diverges at step 2) must exit non-zero with a message naming the step
and the newest checkpoint, and every checkpoint left in --save_dir must load with torch.load
and hold finite tensors only.

usage: nonfinite.py BUILD/bin   (run with the Python that has torch)
"""
import glob
import os
import subprocess
import sys
import tempfile

import torch


def main(bin_dir):
    with tempfile.TemporaryDirectory() as work:
        save = os.path.join(work, "ckpt")
        cmd = [os.path.join(bin_dir, "train_mlp"), "--device=cpu", "--progress=false", "--workers=0",
               "--steps=40", "--lr=1e12", "--save_every=1", "--keep_last=3", f"--save_dir={save}"]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
        print(p.stdout[-3000:])
        assert p.returncode != 0, "a diverging run exited 0"
        assert "training stops before the optimizer step (--on_nonfinite=stop)" in p.stdout, "no stop message"
        assert "the newest checkpoint is " in p.stdout, "the message does not name the newest checkpoint"
        files = sorted(glob.glob(os.path.join(save, "step-*.pt")))
        assert files, "no checkpoint was saved before the run diverged"
        for f in files:
            ckpt = torch.load(f, map_location="cpu", weights_only=True)
            for part in ("model", "optimizer"):
                for name, t in ckpt.get(part, {}).items():
                    if torch.is_tensor(t) and t.is_floating_point():
                        assert torch.isfinite(t).all(), f"{f}: {part} {name} is not finite"
        print(f"ok: stopped with exit {p.returncode}; {len(files)} checkpoint file(s), all finite")


if __name__ == "__main__":
    main(sys.argv[1])
