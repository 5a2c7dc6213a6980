"""What the example tests share: their command line, running a program and finding a run's newest
checkpoint."""
import argparse
import atexit
import glob
import os
import shlex
import shutil
import subprocess
import sys
import tempfile


def example_parser():
    """The arguments ctest gives every example test (tests/examples/CMakeLists.txt): --bin BUILD/bin
    and --mpirun "mpirun ..."; a test adds its own before parse_args()."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--mpirun", required=True)
    return ap


def python_example_args(name):
    """The arguments of an example test that also runs Python (example_parser's and --python,
    the build's interpreter with torch), the mpirun command split into a list, and a new scratch
    directory dtrain_<name>_* under $TMPDIR, removed when the test exits (passed or failed; kept
    with DTRAIN_KEEP_SCRATCH=1, to look into a failure)."""
    ap = example_parser()
    ap.add_argument("--python", required=True)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix=f"dtrain_{name}_")
    if os.environ.get("DTRAIN_KEEP_SCRATCH") != "1":
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    else:
        print(f"scratch directory (DTRAIN_KEEP_SCRATCH=1, kept): {tmp}", flush=True)
    return args, shlex.split(args.mpirun), tmp


def run(cmd, expect=0, env=None, tail=2000):
    """Runs cmd, prints the command and the last `tail` characters of its output; exits the test
    unless it succeeded (expect=0) or failed (expect != 0) as expected. Returns the output."""
    print("$", " ".join(shlex.quote(c) if len(c) < 200 else "<script>" for c in cmd), flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, env=env)
    print(p.stdout[-tail:], flush=True)
    if (expect == 0) != (p.returncode == 0):
        sys.exit(f"FAIL: exit status {p.returncode}, expected {'0' if expect == 0 else 'non-zero'}")
    return p.stdout


def stdout_of(cmd):
    """Runs cmd and returns its standard output alone (the logs go to stderr); exits the test when
    it fails."""
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    if p.returncode != 0:
        sys.exit(f"FAIL: exit status {p.returncode}: {p.stderr[-2000:]}")
    return p.stdout


def json_lines(out):
    """The JSON objects of a program's output: its lines that start with "{"."""
    import json
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def check(cond, what, out=""):
    """Exits the test with FAILED: what (and the output) unless cond."""
    if not cond:
        print("FAILED:", what)
        if out:
            print(out)
        sys.exit(1)


def newest_main_file(ck):
    """The newest checkpoint's main file (what torch.load reads) in the run directory ck."""
    files = sorted(f for f in glob.glob(os.path.join(ck, "step-*.pt")) if ".rank-" not in f)
    assert files, f"no checkpoint in {ck}"
    return files[-1]
