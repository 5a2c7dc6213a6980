"""Language models on token shards: train_gpt --model=llama reads exactly the windows the
documented sampling rule names, in every layout and across a resume.

The rule (docs/ARCHITECTURE.md, data.h, token_shards.h): shard s of T_s tokens gives
floor((T_s - 1) / S) windows of S + 1 tokens with stride S, numbered shard after shard; epoch e
visits them in the permutation drawn from (seed, e) by splitmix64 + Fisher-Yates; global batch
k of an epoch is order[k G, (k + 1) G) with G = batch_size x data-parallel ranks.

Here a reference sampler written in Python from that rule picks each step's windows, and
transformers' LlamaForCausalLM (the weights dtrain starts from, --init_from_hf) scores them. At
--lr=1e-30 without weight decay the float32 weights do not change, so the loss dtrain logs at
each step is the loss of the windows it read: it must equal the reference's for every step, at 1
rank, 2 data-parallel ranks, 2 tensor-parallel ranks, for a run stopped at step 6 on 2 ranks
and resumed on 1, and for one stopped after 4 global batches of 4 and resumed with batches of 8
(the same windows, from window 16); a resume with another --seed is refused.
"""
import json
import os
import subprocess
import sys

from .common import train

S, VOCAB, SEED, STEPS, GLOBAL = 16, 96, 7, 12, 8

# Writes the Hugging Face model and two llm.c shards (GPT-2 layout: 256 int32 header, uint16).
MAKE = r"""
import sys, numpy as np, torch
from transformers import LlamaConfig, LlamaForCausalLM
out, S, V = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(3)
cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
LlamaForCausalLM(cfg).float().save_pretrained(out + "/hf", safe_serialization=True)
rng = np.random.default_rng(4)
for name, n in (("a", 23 * S + 5), ("b", 19 * S + 1)):  # 23 and 19 windows (a's tail is unused)
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, n
    with open(f"{out}/shards/{name}.bin", "wb") as f:
        f.write(header.tobytes())
        f.write(rng.integers(0, V, n).astype(np.uint16).tobytes())
"""

# The reference: the rule above in Python, and transformers' mean loss of each step's windows.
REFERENCE = r"""
import sys, json, glob, numpy as np, torch
from transformers import LlamaForCausalLM
hf, shards, S, seed, steps, G = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
M = (1 << 64) - 1
def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)
class SplitMix64:
    def __init__(self, state): self.state = state
    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & M
        return mix64(self.state)
    def below(self, n):  # uniform in [0, n): rejects the lowest 2^64 mod n values
        threshold = ((1 << 64) - n) % n
        x = self.next()
        while x < threshold: x = self.next()
        return x % n
def permutation(n, seed, epoch):
    gen, perm = SplitMix64(mix64((mix64(seed) + epoch) & M)), list(range(n))
    for i in range(n - 1, 0, -1):
        j = gen.below(i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm
windows = []
for path in sorted(glob.glob(shards + "/*.bin")):
    tokens = np.fromfile(path, dtype=np.uint16, offset=1024).astype(np.int64)
    windows += [tokens[k * S:k * S + S + 1] for k in range((len(tokens) - 1) // S)]
per_epoch = len(windows) // G
model = LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
losses = []
for step in range(steps):
    epoch, k = divmod(step, per_epoch)
    batch = torch.tensor(np.stack([windows[i] for i in permutation(len(windows), seed, epoch)[k * G:(k + 1) * G]]))
    with torch.no_grad():
        logits = model(batch[:, :S]).logits
    losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item())
print(json.dumps({"windows": len(windows), "per_epoch": per_epoch, "losses": losses}))
"""


def check(name, rows, want, first=1, tol=2e-5, last=STEPS):
    got = [(r["step"], r["loss"]) for r in rows if r["step"] >= first]
    assert [s for s, _ in got] == list(range(first, last + 1)), f"{name}: steps {[s for s, _ in got]}"
    worst = 0.0
    for step, loss in got:
        rel = abs(loss - want[step - 1]) / abs(want[step - 1])
        worst = max(worst, rel)
        if rel > tol:
            sys.exit(f"FAIL: {name}: step {step} loss {loss} but the reference sampler's windows give "
                     f"{want[step - 1]} (relative {rel:.3g}): dtrain read other windows")
    print(f"ok: {name}: steps {first}-{last} read the reference sampler's windows (worst relative {worst:.1e})")


def scenario_tokens(args):
    w = args.workdir
    os.makedirs(os.path.join(w, "shards"), exist_ok=True)
    subprocess.run([args.python, "-c", MAKE, w, str(S), str(VOCAB)], check=True)
    hf, shards = os.path.join(w, "hf"), os.path.join(w, "shards")
    out = subprocess.run([args.python, "-c", REFERENCE, hf, shards, str(S), str(SEED), str(STEPS), str(GLOBAL)],
                         check=True, stdout=subprocess.PIPE, text=True).stdout
    ref = json.loads(out.strip().splitlines()[-1])
    assert ref["windows"] == 42 and ref["per_epoch"] == 5, ref  # 12 steps cross two epoch boundaries
    want = ref["losses"]
    common = ["--model=llama", f"--hf_config={hf}/config.json", f"--init_from_hf={hf}", f"--seq_len={S}",
              "--data=tokens", f"--data_path={shards}", f"--seed={SEED}", "--lr=1e-30", "--weight_decay=0", "--workers=2"]
    check("1 rank x 8", train(args, "train_gpt", 1, common + [f"--steps={STEPS}", "--batch_size=8"], "t1"), want)
    check("2 ranks x 4", train(args, "train_gpt", 2, common + [f"--steps={STEPS}", "--batch_size=4"], "t2"), want)
    check("--tp=2 x 8", train(args, "train_gpt", 2, common + [f"--steps={STEPS}", "--batch_size=8", "--tp=2"], "tp2"),
          want)
    ck = os.path.join(w, "ck")
    train(args, "train_gpt", 2, common + ["--steps=6", "--batch_size=4", f"--save_dir={ck}"], "part")
    resumed = train(args, "train_gpt", 1, common + [f"--steps={STEPS}", "--batch_size=8", f"--save_dir={ck}",
                                                    "--resume=yes"], "resumed")
    check("stopped at step 6 on 2 ranks, resumed on 1", resumed, want, first=7)
    # Another global batch on resume: 4 steps of 4 windows on 1 rank, then 2 ranks x 4 (a global
    # batch of 8): the run goes on at window 16 of the epoch's order, the reference's batch 2 on
    # (before, the saved batch index 4 was taken as a batch of 8: windows 16-31 were skipped).
    ck2 = os.path.join(w, "ck2")
    train(args, "train_gpt", 1, common + ["--steps=4", "--batch_size=4", f"--save_dir={ck2}"], "g4")
    resumed = train(args, "train_gpt", 2, common + [f"--steps={STEPS - 2}", "--batch_size=4", f"--save_dir={ck2}",
                                                    "--resume=yes"], "g8")
    check("4 steps of 4 windows, resumed on 2 ranks x 4", resumed, [None, None] + want, first=5, last=STEPS - 2)
    # Another seed on resume would read the epoch's rest in another order: refused.
    out = train(args, "train_gpt", 1, [f if f != f"--seed={SEED}" else f"--seed={SEED + 1}" for f in common] + [
        f"--steps={STEPS}", "--batch_size=8", f"--save_dir={ck2}", "--resume=yes"], "seed", expect_status=2)
    assert f"was drawn with seed {SEED}, this run's with {SEED + 1}" in out, "another --seed was not refused"
