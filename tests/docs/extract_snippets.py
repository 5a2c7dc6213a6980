#!/usr/bin/env python3
"""Compiles and runs docs/API.md: turns every ```cpp block of the page into C++ files.

    extract_snippets.py API.md OUT.cc ALONE.cc         write both files (the build does this)
    extract_snippets.py --check API.md OUT.cc ALONE.cc [--binary BIN]
                                                      the test: the files are what API.md gives
                                                      now, and BIN lists the same blocks
    extract_snippets.py --run API.md --binary BIN --alone-binary BIN2
                                                      the test: runs every block that has an
                                                      int main(), checks its output

Convention (also stated at the top of API.md): block N (counting ```cpp blocks from 1) is
namespace-scope C++ placed inside `namespace api_snippet_N { ... }`, so it may define types,
functions and an `int main(...)` of its own; its `#include` lines are moved to the top of the
file (each header once), so every block sees every header but no other block's names.
`#line` directives make compiler messages name API.md and the line of the page.

Running: a block that defines `int main(` must be followed on the page (after its closing fence
and blank lines) by a comment that says how to run it and what it must print:

    <!-- snippet-run: {"args": ["--steps=20"], "expect": ["^step 20: loss"], "alone": false} -->

The generated main() runs block N for `--run=N ARGS...` (its main gets argv[0] and ARGS) and
lists the blocks for `--list`. `expect` holds regular expressions (multi-line mode) that the
block's stdout + stderr must each match; the block must exit 0. A block marked "alone" is also
written, by itself, into ALONE.cc, which the build compiles without the precompiled header:
the block's own include order is then the one a user's program has (e.g. <glog/logging.h>
before dtrain's headers), and it is run from that binary. Each block runs in a fresh temporary
directory, as one process.

A block fenced with no language or as C++ under another name (```c++, ```cc, ...) is an error
naming its line: C++ is fenced ```cpp (and compiled); anything else names its language
(```bash, ```text, ```cmake, ...). So no C++ escapes compilation.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
INCLUDE = re.compile(r"^\s*#\s*include\b")
# Info strings that mean C++ (or nothing) but are not the one compiled spelling, "cpp".
REFUSED = {"", "c++", "cc", "cxx", "cplusplus", "h", "hh", "hpp", "hxx", "cu", "cuda"}
MAIN = re.compile(r"^int main\(")
RUN = re.compile(r"^<!--\s*snippet-run:\s*(\{.*\})\s*-->\s*$")


class PageError(Exception):
    pass


def parse_blocks(path):
    """[Block] of the ```cpp blocks: the opening fence's line, the body [(line number, text)],
    and the run spec of a block that has an int main() (None otherwise)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, errors = [], []
    open_fence = None  # (fence characters, line number, info, body)
    for number, line in enumerate(lines, start=1):
        m = FENCE.match(line)
        if open_fence is None:
            if not m:
                continue
            fence, info = m.group(2), m.group(3).strip()
            if fence[0] == "`" and "`" in info:
                continue  # an inline code span such as ```x``` at the start of a line
            word = info.split()[0].lower() if info else ""
            if word in REFUSED:
                shown = "```" + (info.split()[0] if info else "")
                errors.append(f"{path}:{number}: code block fenced as {shown}: fence C++ as ```cpp "
                              f"(it is compiled by the test suite) and anything else with its "
                              f"language (```bash, ```text, ```cmake, ...)")
            open_fence = (fence, number, word, [])
            continue
        fence, start, word, body = open_fence
        if m and m.group(2)[0] == fence[0] and len(m.group(2)) >= len(fence) and not m.group(3).strip():
            if word == "cpp":
                if not any(text.strip() for _, text in body):
                    errors.append(f"{path}:{start}: empty ```cpp block")
                blocks.append(Block(start, body, run_spec(path, lines, number, body, errors)))
            open_fence = None
            continue
        body.append((number, line))
    if open_fence is not None:
        errors.append(f"{path}:{open_fence[1]}: code block never closed")
    if not blocks and not errors:
        errors.append(f"{path}: no ```cpp block found")
    if errors:
        raise PageError("\n".join(errors))
    return blocks


class Block:
    def __init__(self, start, body, run):
        self.start, self.body, self.run = start, body, run


def run_spec(path, lines, closing, body, errors):
    """The snippet-run comment after a block that defines int main() (the block's closing fence
    is line `closing`); an error for a main without one, or a comment on a block without main."""
    has_main = any(MAIN.match(text) for _, text in body)
    follow = closing  # index of the line after the fence
    while follow < len(lines) and not lines[follow].strip():
        follow += 1
    m = RUN.match(lines[follow]) if follow < len(lines) else None
    where = f"{path}:{follow + 1}"
    if m and not has_main:
        errors.append(f"{where}: a snippet-run comment after a block without int main(): remove it")
        return None
    if not has_main:
        return None
    if not m:
        errors.append(f"{path}:{closing}: this block defines int main(), so the test suite runs it: follow "
                      f"its closing fence with <!-- snippet-run: {{\"args\": [...], \"expect\": [\"regex\", "
                      f"...]}} --> saying how to run it and what it prints")
        return None
    try:
        spec = json.loads(m.group(1))
    except json.JSONDecodeError as e:
        errors.append(f"{where}: the snippet-run comment is not JSON: {e}")
        return None
    unknown = set(spec) - {"args", "expect", "alone", "timeout"}
    if unknown or not isinstance(spec.get("expect"), list) or not spec["expect"]:
        errors.append(f"{where}: snippet-run takes args (a list), expect (a non-empty list of regular "
                      f"expressions), alone (true/false) and timeout (seconds)"
                      + (f"; unknown: {', '.join(sorted(unknown))}" if unknown else ""))
        return None
    spec.setdefault("args", [])
    spec.setdefault("alone", False)
    spec.setdefault("timeout", 120)
    return spec


def c_string(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def generate(md_path, out_path, blocks, numbers, what):
    """The C++ file of the blocks `numbers` (1-based block numbers of the page)."""
    md = c_string(md_path)
    out = []

    def emit(text=""):
        out.append(text)

    chosen = [(n, blocks[n - 1]) for n in numbers]
    emit(f"// Generated from {md_path} by tests/docs/extract_snippets.py: do not edit.")
    emit(f"// {what}")
    seen = set()
    for _, block in chosen:
        for number, text in block.body:
            if INCLUDE.match(text) and text.strip() not in seen:
                seen.add(text.strip())
                emit(f"#line {number} {md}")
                emit(text.strip())
    # The generated main's own headers come after the page's, which keep their order.
    emit(f"#line {len(out) + 2} {c_string(out_path)}")
    emit("#include <cstdio>")
    emit("#include <cstring>")
    emit("#include <cstdlib>")
    for index, block in chosen:
        emit()
        emit(f"namespace api_snippet_{index} {{  // {md_path}:{block.start}")
        emit(f"#line {block.body[0][0]} {md}")
        for _, text in block.body:
            emit("" if INCLUDE.match(text) else text)
        emit(f"}}  // namespace api_snippet_{index}")
    emit()
    emit(f"#line {len(out) + 2} {c_string(out_path)}")
    emit("namespace {")
    emit("struct Listed { int block; int line; int (*main)(int, char**); };")
    emit("const Listed kBlocks[] = {")
    for index, block in chosen:
        fn = f"&api_snippet_{index}::main" if block.run else "nullptr"
        emit(f"    {{{index}, {block.start}, {fn}}},")
    emit("};")
    emit("}  // namespace")
    emit()
    emit("// --list: the blocks; --run=N ARGS...: block N's main with argv[0] and ARGS.")
    emit("int main(int argc, char** argv) {")
    emit("  const int n = static_cast<int>(sizeof(kBlocks) / sizeof(kBlocks[0]));")
    emit('  if (argc >= 2 && std::strncmp(argv[1], "--run=", 6) == 0) {')
    emit("    const int want = std::atoi(argv[1] + 6);")
    emit("    for (int i = 0; i < n; ++i) {")
    emit("      if (kBlocks[i].block != want || !kBlocks[i].main) continue;")
    emit("      argv[1] = argv[0];")
    emit("      return kBlocks[i].main(argc - 1, argv + 1);")
    emit("    }")
    emit('    std::fprintf(stderr, "%s: no runnable block %d here\\n", argv[0], want);')
    emit("    return 2;")
    emit("  }")
    emit('  if (argc > 2 || (argc == 2 && std::strcmp(argv[1], "--list") != 0)) {')
    emit('    std::fprintf(stderr, "usage: %s [--list | --run=N ARGS...]\\n", argv[0]);')
    emit("    return 2;")
    emit("  }")
    emit(f'  std::printf("%d cpp blocks of %s compiled\\n", n, {md});')
    emit("  for (int i = 0; i < n; ++i) {")
    emit(f'    std::printf("api_snippet_%d: %s:%d%s\\n", kBlocks[i].block, {md}, kBlocks[i].line,')
    emit('                kBlocks[i].main ? " (runs)" : "");')
    emit("  }")
    emit("  return 0;")
    emit("}")
    return "\n".join(out) + "\n"


def generate_both(md_path, out_path, alone_path):
    blocks = parse_blocks(md_path)
    everything = list(range(1, len(blocks) + 1))
    alone = [n for n in everything if blocks[n - 1].run and blocks[n - 1].run["alone"]]
    if not alone:
        raise PageError(f"{md_path}: no block is marked \"alone\": mark the logging example so, which "
                        f"checks a user's include order (glog first)")
    text = generate(md_path, out_path, blocks, everything,
                    "Every ```cpp block of the page, each in a namespace of its own (with the precompiled header).")
    alone_text = generate(md_path, alone_path, blocks, alone,
                          "The blocks marked \"alone\", compiled without the precompiled header: their own include order.")
    return text, alone_text, blocks


def run_blocks(md_path, binary, alone_binary, blocks):
    failures = 0
    for index, block in enumerate(blocks, start=1):
        if not block.run:
            continue
        spec = block.run
        program = alone_binary if spec["alone"] else binary
        cmd = [program, f"--run={index}"] + spec["args"]
        with tempfile.TemporaryDirectory() as work:
            env = dict(os.environ)
            # One process, on the CPU, with INFO lines shown (the checks may look for them).
            env["GLOG_minloglevel"] = "0"
            for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE"):
                env.pop(var, None)
            try:
                run = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True,
                                     timeout=spec["timeout"])
            except subprocess.TimeoutExpired:
                print(f"FAIL {md_path}:{block.start}: `{' '.join(cmd)}` ran over {spec['timeout']} s")
                failures += 1
                continue
        output = run.stdout + run.stderr
        missing = [e for e in spec["expect"] if not re.search(e, output, re.M)]
        if run.returncode != 0 or missing:
            print(f"FAIL {md_path}:{block.start}: `{' '.join(cmd)}` exited {run.returncode}"
                  + (f"; its output matches none of: {missing}" if missing else "")
                  + f"\n----- its output -----\n{output}-----")
            failures += 1
        else:
            print(f"ok {md_path}:{block.start}: block {index} ran ({'alone, ' if spec['alone'] else ''}"
                  f"{len(spec['expect'])} expectation(s) met)")
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="verify the outputs instead of writing them")
    ap.add_argument("--run", action="store_true", help="run the blocks that have an int main()")
    ap.add_argument("--binary", help="the compiled snippets program")
    ap.add_argument("--alone-binary", help="with --run: the program of the blocks marked alone")
    ap.add_argument("markdown")
    ap.add_argument("output", nargs="?")
    ap.add_argument("alone_output", nargs="?")
    args = ap.parse_args()
    args.markdown = os.path.abspath(args.markdown)
    if args.run:
        if not args.binary or not args.alone_binary:
            ap.error("--run needs --binary and --alone-binary")
        args.binary, args.alone_binary = os.path.abspath(args.binary), os.path.abspath(args.alone_binary)
        try:
            blocks = parse_blocks(args.markdown)
        except PageError as e:
            print(e, file=sys.stderr)
            return 1
        failures = run_blocks(args.markdown, args.binary, args.alone_binary, blocks)
        ran = sum(1 for b in blocks if b.run)
        if ran == 0:
            print(f"{args.markdown}: no block has an int main(): nothing ran", file=sys.stderr)
            return 1
        print(f"{args.markdown}: {ran - failures} of {ran} runnable blocks passed")
        return 1 if failures else 0
    if not args.output or not args.alone_output:
        ap.error("OUT.cc and ALONE.cc are needed")
    # The generated text names the files; absolute paths make it the same from any directory.
    args.output, args.alone_output = os.path.abspath(args.output), os.path.abspath(args.alone_output)
    try:
        text, alone_text, blocks = generate_both(args.markdown, args.output, args.alone_output)
    except PageError as e:
        print(e, file=sys.stderr)
        return 1
    lines = [b.start for b in blocks]
    if not args.check:
        for path, content in ((args.output, text), (args.alone_output, alone_text)):
            with open(path, "w", encoding="utf-8") as f:
                f.write(content)
        return 0
    for path, content in ((args.output, text), (args.alone_output, alone_text)):
        try:
            with open(path, encoding="utf-8") as f:
                current = f.read()
        except OSError as e:
            print(f"{path}: {e.strerror}; build the dtrain_api_snippets target first", file=sys.stderr)
            return 1
        if current != content:
            print(f"{path} is out of date with {args.markdown}: rebuild the dtrain_api_snippets "
                  f"target (ninja -C <build> dtrain_api_snippets), which compiles the page's blocks",
                  file=sys.stderr)
            return 1
    if args.binary:
        try:
            run = subprocess.run([args.binary, "--list"], capture_output=True, text=True)
        except OSError as e:
            print(f"{args.binary}: {e.strerror}; build the dtrain_api_snippets target", file=sys.stderr)
            return 1
        listed = [int(m.group(1)) for m in re.finditer(r"^api_snippet_\d+: .*:(\d+)( \(runs\))?$", run.stdout, re.M)]
        if run.returncode != 0 or listed != lines:
            print(f"{args.binary} --list (exit {run.returncode}) lists blocks at lines {listed}, but "
                  f"{args.markdown} has them at {lines}: rebuild dtrain_api_snippets\n{run.stdout}{run.stderr}",
                  file=sys.stderr)
            return 1
    print(f"{args.markdown}: {len(blocks)} ```cpp blocks (lines {', '.join(map(str, lines))}), "
          f"all in {args.output}" + (f" and compiled into {args.binary}" if args.binary else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
