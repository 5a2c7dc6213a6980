#!/usr/bin/env python3
"""Layouts of one training run must log the same loss curve (ARCHITECTURE.md).

Runs an example program in several data-parallel / accumulation layouts that share the
global batch, reads each run's metrics file and compares the losses step by step with
the single-rank, single-micro-batch run (the reference). Exits non-zero on a mismatch.
The scenarios are in curves/ beside this file (common.py: running and comparing).

usage: loss_curves.py SCENARIO --bin BUILD/bin --mpirun "mpirun ..." [--workdir DIR]
"""
import argparse
import os
import sys
import tempfile

# The scenarios' package lies beside this file (not installed): importable wherever ctest runs it.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from curves import language, parallel, state, techniques  # noqa: E402

# The name on the command line (tests/examples/CMakeLists.txt registers each) -> its scenario.
SCENARIOS = {
    "data_parallel": parallel.scenario_data_parallel,
    "amp": parallel.scenario_amp,
    "seq2seq": parallel.scenario_seq2seq,
    "tensor_parallel": parallel.scenario_tensor_parallel,
    "observability": state.scenario_observability,
    "checkpoint": state.scenario_checkpoint,
    "checkpoint_tp": state.scenario_checkpoint_tp,
    "offload": techniques.scenario_offload,
    "offload_stream": techniques.scenario_offload_stream,
    "bf16_master": techniques.scenario_bf16_master,
    "plan": techniques.scenario_plan,
    "sequence_parallel": parallel.scenario_sequence_parallel,
    "context_parallel": parallel.scenario_context_parallel,
    "distill": techniques.scenario_distill,
    "sparse": techniques.scenario_sparse,
    "pipeline": parallel.scenario_pipeline,
    "zero3": parallel.scenario_zero3,
    "traps": state.scenario_traps,
    "reshard": state.scenario_reshard,
    "tokens": language.scenario_tokens,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=list(SCENARIOS))
    ap.add_argument("--full", action="store_true", help="reshard: every layout, not only CI's")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--source", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    ap.add_argument("--bin", required=True)
    ap.add_argument("--mpirun", required=True)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.workdir = args.workdir or tmp
        SCENARIOS[args.scenario](args)


if __name__ == "__main__":
    main()
