#!/usr/bin/env python3
"""dtrain-plan --simulate and --calibrate on the command line:

1. one layout (GPT-124M's shape on one H100): exit 0, the prediction line and its JSON;
2. a model no single GPU holds: exit 1, "does not fit", naming both sizes;
   ... and --search finds it a layout with its blocks streamed from the host (--offload=all).
3. --search on 8 A100s: the best layout's flags, priced again alone with --simulate, give the
   same step time; --scaling_nodes gives one JSON line per node count;
4. --calibrate on this CPU writes a cluster file that --cluster reads, and the prediction of the
   calibrated layout lands within 30% of the trainer's step the calibration measured; so does
   the prediction of the model --measure timed through its ModelSpec (--simulate --measured);
5. train_gpt --plan=auto --plan_cluster=FILE ranks its candidates by the simulator (and
   --plan_cluster without --plan=auto, or for seq2seq, is exit 2);
6. bad input: exit 2 with a message naming the problem (a model the simulator does not price,
   a layout that does not divide the ranks, --scaling_nodes without --search or with a bad
   count, a missing or malformed cluster file).

usage: simulate_cli.py BIN_DIR
"""
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from example_util import check, json_lines

GPT124M = ["--model=gpt", "--layers=12", "--d_model=768", "--heads=12", "--ff=3072", "--vocab=50304",
           "--seq_len=1024"]


def run(bin_dir, *flags, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="1")
    p = subprocess.run([os.path.join(bin_dir, "dtrain-plan"), *flags], capture_output=True, text=True, env=env,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def main():
    b = sys.argv[1]
    # 1. One layout.
    rc, out, err = run(b, "--simulate", *GPT124M, "--batch_size=8", "--amp=bf16", "--gpus_per_node=1")
    check(rc == 0, "--simulate of gpt124m on one H100", out + err)
    j = json_lines(out)[-1]
    check(j["fits"] and j["step_s"] > 0 and 0 < j["mfu"] < 1, "a fitting prediction with an MFU in (0, 1)", out)
    check(j["flags"] == "--batch_size=8 --amp=bf16", "the layout's flags: " + j["flags"], out)
    check("predicted: dp 1 tp 1 pp 1" in out and "compute" in out, "the prediction and its parts printed", out)

    # 2. Too large for one GPU.
    rc, out, err = run(b, "--simulate", "--model=llama", "--layers=80", "--d_model=8192", "--heads=64",
                       "--kv_heads=8", "--ff=28672", "--vocab=128256", "--seq_len=4096", "--batch_size=1",
                       "--gpus_per_node=1")
    check(rc == 1 and "does not fit" in out and "GiB per rank" in out, "a 70B model on one GPU does not fit",
          out + err)
    # ... but it trains with its blocks streamed from the host: the search ranks layer offload.
    llama70b = ["--model=llama", "--layers=80", "--d_model=8192", "--heads=64", "--kv_heads=8", "--ff=28672",
                "--vocab=128256", "--seq_len=4096", "--gpus_per_node=1", "--amp=bf16"]
    rc, out, err = run(b, "--simulate", "--search", *llama70b, "--global_batch=8")
    best = json_lines(out)[-1] if rc == 0 else {}
    check(rc == 0 and "--offload=all" in best.get("flags", "") and best["host_bytes"] > 0,
          "a 70B model on one GPU: the search streams its blocks from the host", out + err)

    # 3. The search, and its best layout priced alone.
    a100 = ["--gpus_per_node=8", "--gpu=a100", "--amp=bf16"]
    rc, out, err = run(b, "--simulate", "--search", *GPT124M, "--tie_embeddings", "--global_batch=512", "--top=3",
                       *a100)
    check(rc == 0 and "best: " in out, "--search prints the best layout's flags", out + err)
    best = json_lines(out)[-1]
    check(best["layouts_that_fit"] > 10 and best["global_batch"] == 512, "many layouts fit 512 sequences", out)
    ranked = [l for l in out.splitlines() if re.match(r"\s*\d+\. dp ", l)]
    check(len(ranked) == 3, "--top=3 prints three layouts", out)
    rc, again, err = run(b, "--simulate", *GPT124M, "--tie_embeddings", *a100, *best["flags"].split())
    check(rc == 0, "the best layout priced alone: " + best["flags"], again + err)
    alone = json_lines(again)[-1]
    check(abs(alone["step_s"] - best["step_s"]) <= 1e-9 * best["step_s"],
          "the same step time alone (%g) as in the search (%g)" % (alone["step_s"], best["step_s"]), again)
    # Tied embeddings: train_gpt refuses them with ZeRO-3 and pipeline stages, so the search's best
    # is neither (it was --shard=parameters before a user audit).
    check("does not run" not in again and "--shard=parameters" not in best["flags"] and "--pp=" not in best["flags"],
          "the tied model's best is a layout dtrain runs: " + best["flags"], again)
    rc, out, err = run(b, "--simulate", "--search", *GPT124M, "--global_batch=64", "--scaling_nodes=1,2", *a100)
    lines = json_lines(out)
    check(rc == 0 and [l["nodes"] for l in lines] == [1, 2] and lines[1]["ranks"] == 16,
          "--scaling_nodes=1,2: one line per node count", out + err)

    # 4. Calibrate this machine, then predict the layout it timed.
    small = ["--model=gpt", "--layers=2", "--d_model=64", "--heads=4", "--ff=256", "--vocab=512", "--seq_len=64",
             "--batch_size=8", "--device=cpu"]
    with tempfile.TemporaryDirectory() as w:
        cluster = os.path.join(w, "cluster.json")
        rc, out, err = run(b, *small, "--calibrate=" + cluster, timeout=300)
        check(rc == 0 and os.path.exists(cluster), "--calibrate writes the cluster file", out + err)
        m = re.search(r"trainer step ([0-9.]+) ms", out)
        check(m is not None, "--calibrate prints the trainer's step", out)
        measured = float(m.group(1)) / 1e3
        c = json.load(open(cluster))
        check(c["device"]["name"] == "calibrated-cpu" and c["device"]["peak_flops"] > 1e8 and
              len(c["compute_scale_points"]) >= 1, "the file holds the measured device", json.dumps(c))
        rc, out, err = run(b, "--simulate", "--cluster=" + cluster, "--gpus_per_node=1", *small)
        check(rc == 0, "--simulate with the calibrated cluster", out + err)
        predicted = json_lines(out)[-1]["step_s"]
        check(abs(predicted - measured) <= 0.3 * measured,
              "the calibrated prediction %.4f s within 30%% of the measured %.4f s" % (predicted, measured), out)
        # A model measured through its ModelSpec (the path of a user's own model). The blocks are
        # timed in another process than the calibration's trainer step, at another moment of a
        # machine ctest shares with a second job (a load that came and went made one trainer step
        # 17.6 ms against the blocks' 10.2): the median of three measurements is compared with
        # the median of the trainer's steps timed beside them (a calibration after each).
        measured_file = os.path.join(w, "measured.json")
        by_spec, trainer_steps = [], [measured]
        for _ in range(3):
            rc, out, err = run(b, *small, "--measure=" + measured_file, timeout=300)
            check(rc == 0 and "measure: wrote" in out, "--measure writes the measured model", out + err)
            mm = json.load(open(measured_file))
            check(mm["blocks"] == 2 and mm["block_parameters"] > 0 and mm["activation_bytes_per_row"] == 64 * 64 * 4,
                  "the measured model's blocks, parameters and message", json.dumps(mm))
            rc, out, err = run(b, "--simulate", "--cluster=" + cluster, "--measured=" + measured_file,
                               "--gpus_per_node=1", *small)
            check(rc == 0, "--simulate --measured", out + err)
            by_spec.append(json_lines(out)[-1]["step_s"])
            rc, out2, err = run(b, *small, "--calibrate=" + os.path.join(w, "again.json"), timeout=300)
            m = re.search(r"trainer step ([0-9.]+) ms", out2)
            check(rc == 0 and m is not None, "--calibrate again prints the trainer's step", out2 + err)
            trainer_steps.append(float(m.group(1)) / 1e3)
        median = statistics.median(by_spec)
        trainer = statistics.median(trainer_steps)
        check(abs(median - trainer) <= 0.3 * trainer,
              "the measured model's prediction %.4f s (median of %s) within 30%% of the trainer's %.4f s (median of %s)" %
              (median, ", ".join("%.4f" % t for t in by_spec), trainer, ", ".join("%.4f" % t for t in trainer_steps)),
              out)
        rc, out, err = run(b, "--simulate", "--cluster=" + cluster, "--measured=" + measured_file, "--gpus_per_node=2",
                           "--tp=2", *small)
        check(rc == 2 and "without tensor and context" in err, "--measured with --tp=2: exit 2", out + err)
        # The measured model's times are its machine's, its shape its own (a user audit priced CPU
        # times on a named H100, and another shape's flags with the measured file's times).
        rc, out, err = run(b, "--simulate", "--measured=" + measured_file, "--gpus_per_node=1", *small)
        check(rc == 2 and "give that machine's --cluster" in err, "--measured without --cluster: exit 2", out + err)
        other = [f if not f.startswith("--layers=") else "--layers=7" for f in small]
        rc, out, err = run(b, "--simulate", "--cluster=" + cluster, "--measured=" + measured_file, "--gpus_per_node=1",
                           *other)
        check(rc == 2 and "the file gives the model" in err, "--measured with another shape's flags: exit 2", out + err)
        rc, out, err = run(b, "--simulate", "--cluster=" + cluster, *other)
        check(rc == 0 and "was calibrated on" in err, "another shape than the calibrated one is warned", out + err)
        rc, out, err = run(b, "--simulate", "--cluster=" + cluster, "--gpu=h100", *small)
        check(rc == 2 and "give one of them" in err, "--gpu with --cluster: exit 2", out + err)
        rc, out, err = run(b, "--model=seq2seq", "--device=cpu", "--measure=" + measured_file)
        check(rc == 2 and "ModelSpec" in err, "--measure of a model without a spec: exit 2", out + err)

        # --plan=auto ranks its candidates by the simulator with --plan_cluster.
        train = [os.path.join(b, "train_gpt")] + [f for f in small if f != "--model=gpt"] + [
            "--data=synthetic", "--steps=1", "--progress=false", "--plan=auto", "--gpu_mem_limit_gb=8",
            "--plan_cluster=" + cluster]
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="0", GLOG_logtostderr="1")
        p = subprocess.run(train, capture_output=True, text=True, env=env, timeout=300)
        check(p.returncode == 0 and "by the step-time model" in p.stderr,
              "train_gpt --plan=auto --plan_cluster ranks by the step-time model", p.stdout + p.stderr[-3000:])
        p = subprocess.run([a for a in train if not a.startswith("--plan=") and not a.startswith("--gpu_mem")],
                           capture_output=True, text=True, env=env, timeout=120)
        check(p.returncode == 2 and "add --plan=auto" in p.stderr, "--plan_cluster without --plan=auto: exit 2",
              p.stdout + p.stderr[-3000:])
        p = subprocess.run([os.path.join(b, "train_seq2seq"), "--device=cpu", "--steps=1", "--plan=auto",
                            "--gpu_mem_limit_gb=8", "--plan_cluster=" + cluster, "--progress=false"],
                           capture_output=True, text=True, env=env, timeout=120)
        check(p.returncode == 2 and "prices the language models" in p.stderr,
              "--plan_cluster with seq2seq: exit 2", p.stdout + p.stderr[-3000:])
        bad = os.path.join(w, "bad.json")
        with open(bad, "w") as f:
            f.write('{"device": {"peak_flops": "fast"}}')
        rc, out, err = run(b, "--simulate", "--cluster=" + bad, *small)
        check(rc == 2 and "peak_flops" in err, "a malformed cluster file names the field", out + err)
        with open(bad, "w") as f:
            f.write('{"devcie": {"peak_flops": 1e12}}')
        rc, out, err = run(b, "--simulate", "--cluster=" + bad, *small)
        check(rc == 2 and '"devcie"' in err, "a misspelled key in the cluster file: exit 2 naming it", out + err)
        llama_config = os.path.join(w, "config.json")
        with open(llama_config, "w") as f:
            json.dump({"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000,
                       "max_position_embeddings": 256}, f)
        rc, out, err = run(b, "--simulate", "--model=gpt", "--seq_len=128", "--hf_config=" + llama_config)
        check(rc == 2 and "use --model=llama" in err, "a Llama config with --model=gpt: exit 2", out + err)

    # 6. Bad input.
    cases = [
        (["--simulate", "--model=seq2seq"], "--model=gpt or llama"),
        (["--simulate", *GPT124M, "--tp=3"], "does not divide"),
        (["--simulate", *GPT124M, "--scaling_nodes=1,2"], "--scaling_nodes needs --search"),
        (["--simulate", "--search", *GPT124M, "--global_batch=8", "--scaling_nodes=1,x"], "is not a node count"),
        (["--simulate", *GPT124M, "--cluster=/nonexistent/cluster.json"], "/nonexistent/cluster.json"),
        (["--simulate", *GPT124M, "--gpu=tpu"], "h100, h200, a100"),
        (["--simulate", *GPT124M, "--inter_node_gbps=-5"], "must be >= 0"),
        (["--simulate", *GPT124M, "--inter_node_latency_us=-7"], "must be >= 0"),
        (["--simulate", *GPT124M, "--global_batch=64"], "--global_batch is the search's"),
        (["--simulate", "--search", *GPT124M, "--global_batch=64", "--tp=2"], "the search chooses"),
        (["--simulate", "--search", *GPT124M, "--global_batch=64", "--amp=fp16"], "give --amp=bf16"),
        (["--simulate", *GPT124M, "--pp=2", "--accum_steps=2", "--batch_size=2", "--pp_schedule=zb",
          "--pp_zb_costs=1,5,1", "--gpus_per_node=2"], "--pp_zb_costs with --simulate"),
        (["--simulate", *[f for f in GPT124M if not f.startswith("--seq_len")], "--seq_len=255", "--tp=2",
          "--sequence_parallel", "--gpus_per_node=2"], "must be a multiple of 2"),
    ]
    for flags, want in cases:
        rc, out, err = run(b, *flags)
        check(rc == 2 and want in err, "%s: exit 2 naming '%s' (got %d)" % (" ".join(flags), want, rc), out + err)
    print("simulate_cli.py: all checks passed")


if __name__ == "__main__":
    main()
