#!/usr/bin/env python3
"""Generation speed: dtrain-generate against transformers' generate on the same Llama, in one run.

A LlamaForCausalLM of the given shape (transformers, random weights, seed 0) is saved with
save_pretrained into a scratch directory; then, alternating, --repeats times each:
  * dtrain-generate --init_from_hf (its summary line on stderr: the new tokens' tokens/s over the
    prompt's pass and the steps after it, weights loaded before the clock starts);
  * transformers' model.generate(do_sample=False, use_cache=True) on the same prompt, timed around
    the call (the model loaded once before).
Both greedy, max_new_tokens new tokens after a prompt of --prompt_len random ids, batch --batch,
float32 (or --dtype), on --device, with --threads intra-op threads each. Prints one JSON line per
program with the median tokens/s, and the ratio dtrain / transformers. The greedy tokens of the
two are compared too (equal where the weights' top-2 logits are not within rounding of a tie;
the line says how many rows agree).

usage: tools/generate_bench.py --bin build/bin [--d_model=512 --layers=8 --heads=8 --kv_heads=4
           --ff=1408 --vocab=32000] [--prompt_len=32 --new=64 --batch=1] [--repeats=5]
           [--device=cpu] [--dtype=float32] [--threads=2]
"""
import argparse
import atexit
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import torch



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    for name, default in (("d_model", 512), ("layers", 8), ("heads", 8), ("kv_heads", 4), ("ff", 1408),
                          ("vocab", 32000), ("prompt_len", 32), ("new", 64), ("batch", 1), ("repeats", 5),
                          ("threads", 2)):
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    positions = max(2048, a.prompt_len + a.new)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.d_model, intermediate_size=a.ff, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=positions,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    dtype = getattr(torch, a.dtype)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    scratch = tempfile.mkdtemp(prefix="dtrain_generate_bench_")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)  # the saved model (hundreds of MB)
    hf = os.path.join(scratch, "hf")
    model.save_pretrained(hf, safe_serialization=True)
    model = model.to(a.device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(a.vocab, (a.prompt_len,), generator=g).tolist()
    prompts = torch.tensor([prompt] * a.batch, device=a.device)
    cmd = [os.path.join(a.bin, "dtrain-generate"), "--model=llama", f"--init_from_hf={hf}",
           f"--hf_config={hf}/config.json", "--prompt_tokens=" + ",".join(map(str, prompt)), f"--batch={a.batch}",
           f"--max_new_tokens={a.new}", "--temperature=0", f"--device={a.device}", f"--dtype={a.dtype}",
           "--output=ids"]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), GLOG_minloglevel="1")
    ours, theirs, agree = [], [], None
    for _ in range(a.repeats):
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"dtrain-generate failed: {p.stderr[-2000:]}")
        m = re.search(r"(\d+) new tokens in \d+ sequences .* in ([0-9.]+) s: ([0-9.]+) tokens/s", p.stderr)
        ours.append(float(m.group(3)))
        rows = [[int(t) for t in line.split(",")] for line in p.stdout.split()]
        with torch.no_grad():
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                 max_new_tokens=a.new, min_new_tokens=a.new, eos_token_id=None, pad_token_id=0)
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        theirs.append(a.batch * a.new / seconds)
        hf_rows = out[:, a.prompt_len:].tolist()
        agree = sum(r == h for r, h in zip(rows, hf_rows))
    shape = {"params_m": round(params / 1e6, 1), "d_model": a.d_model, "layers": a.layers, "heads": a.heads,
             "kv_heads": a.kv_heads, "vocab": a.vocab, "prompt_len": a.prompt_len, "new": a.new, "batch": a.batch,
             "device": a.device, "dtype": a.dtype, "threads": a.threads, "repeats": a.repeats}
    med_ours, med_theirs = statistics.median(ours), statistics.median(theirs)
    print(json.dumps(dict(shape, program="dtrain-generate", tokens_per_s_median=round(med_ours, 1),
                          runs=[round(x, 1) for x in ours])))
    print(json.dumps(dict(shape, program=f"transformers {__import__('transformers').__version__} generate",
                          tokens_per_s_median=round(med_theirs, 1), runs=[round(x, 1) for x in theirs])))
    print(json.dumps({"ratio_dtrain_over_transformers": round(med_ours / med_theirs, 2),
                      "greedy_rows_equal": f"{agree} of {a.batch}"}))


if __name__ == "__main__":
    main()
