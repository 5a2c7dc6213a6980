#!/usr/bin/env python3
"""Compiles docs/API.md: turns every ```cpp block of the page into one C++ file.

    extract_snippets.py API.md OUT.cc                  write OUT.cc (the build does this)
    extract_snippets.py --check API.md OUT.cc [--binary BIN]
                                                      the test: OUT.cc is what API.md gives
                                                      now, and BIN lists the same blocks

Convention (also stated at the top of API.md): block N (counting ```cpp blocks from 1) is
namespace-scope C++ placed inside `namespace api_snippet_N { ... }`, so it may define types,
functions and an `int main(...)` of its own; its `#include` lines are moved to the top of the
file (each header once), so every block sees every header but no other block's names.
`#line` directives make compiler messages name API.md and the line of the page. The blocks
are compiled and linked, never run: the generated main() only lists them.

A block fenced with no language or as C++ under another name (```c++, ```cc, ...) is an error
naming its line: C++ is fenced ```cpp (and compiled); anything else names its language
(```bash, ```text, ```cmake, ...). So no C++ escapes compilation.
"""
import argparse
import os
import re
import subprocess
import sys

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
INCLUDE = re.compile(r"^\s*#\s*include\b")
# Info strings that mean C++ (or nothing) but are not the one compiled spelling, "cpp".
REFUSED = {"", "c++", "cc", "cxx", "cplusplus", "h", "hh", "hpp", "hxx", "cu", "cuda"}


class PageError(Exception):
    pass


def parse_blocks(path):
    """[(line of the opening fence, [(line number, text), ...])] of the ```cpp blocks."""
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
                blocks.append((start, body))
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


def c_string(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def generate(md_path, out_path):
    blocks = parse_blocks(md_path)
    md = c_string(md_path)
    out = []

    def emit(text=""):
        out.append(text)

    emit(f"// Generated from {md_path} by tests/docs/extract_snippets.py: do not edit.")
    emit("// Every ```cpp block of the page, each in a namespace of its own; compiled, never run.")
    emit("#include <cstdio>")
    emit("#include <cstring>")
    emit()
    seen = set()
    for _, body in blocks:
        for number, text in body:
            if INCLUDE.match(text) and text.strip() not in seen:
                seen.add(text.strip())
                emit(f"#line {number} {md}")
                emit(text.strip())
    for index, (start, body) in enumerate(blocks, start=1):
        emit()
        emit(f"namespace api_snippet_{index} {{  // {md_path}:{start}")
        emit(f"#line {body[0][0]} {md}")
        for _, text in body:
            emit("" if INCLUDE.match(text) else text)
        emit(f"}}  // namespace api_snippet_{index}")
    emit()
    emit(f"#line {len(out) + 2} {c_string(out_path)}")
    emit("namespace {")
    emit("const int kBlockLines[] = {" + ", ".join(str(start) for start, _ in blocks) + "};")
    emit("}  // namespace")
    emit()
    emit("// Lists the blocks (none is run: they need a launcher, data and devices).")
    emit("int main(int argc, char** argv) {")
    emit('  if (argc > 2 || (argc == 2 && std::strcmp(argv[1], "--list") != 0)) {')
    emit('    std::fprintf(stderr, "usage: %s [--list]\\n", argv[0]);')
    emit("    return 2;")
    emit("  }")
    emit("  const int n = static_cast<int>(sizeof(kBlockLines) / sizeof(kBlockLines[0]));")
    emit(f'  std::printf("%d cpp blocks of %s compiled\\n", n, {md});')
    emit("  for (int i = 0; i < n; ++i) {")
    emit(f'    std::printf("api_snippet_%d: %s:%d\\n", i + 1, {md}, kBlockLines[i]);')
    emit("  }")
    emit("  return 0;")
    emit("}")
    return "\n".join(out) + "\n", blocks


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="verify OUT.cc instead of writing it")
    ap.add_argument("--binary", help="with --check: the compiled snippets program, whose --list must agree")
    ap.add_argument("markdown")
    ap.add_argument("output")
    args = ap.parse_args()
    # The generated text names the files; absolute paths make it the same from any directory.
    args.markdown, args.output = os.path.abspath(args.markdown), os.path.abspath(args.output)
    try:
        text, blocks = generate(args.markdown, args.output)
    except PageError as e:
        print(e, file=sys.stderr)
        return 1
    lines = [start for start, _ in blocks]
    if not args.check:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        return 0
    try:
        with open(args.output, encoding="utf-8") as f:
            current = f.read()
    except OSError as e:
        print(f"{args.output}: {e.strerror}; build the dtrain_api_snippets target first", file=sys.stderr)
        return 1
    if current != text:
        print(f"{args.output} is out of date with {args.markdown}: rebuild the dtrain_api_snippets "
              f"target (ninja -C <build> dtrain_api_snippets), which compiles the page's blocks",
              file=sys.stderr)
        return 1
    if args.binary:
        try:
            run = subprocess.run([args.binary, "--list"], capture_output=True, text=True)
        except OSError as e:
            print(f"{args.binary}: {e.strerror}; build the dtrain_api_snippets target", file=sys.stderr)
            return 1
        listed = [int(m.group(1)) for m in re.finditer(r"^api_snippet_\d+: .*:(\d+)$", run.stdout, re.M)]
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
