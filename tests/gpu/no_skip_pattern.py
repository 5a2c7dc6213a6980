#!/usr/bin/env python3
"""Fails when a GPU test carries SKIP_REGULAR_EXPRESSION: ctest would then report the whole test
as skipped whenever one gtest case skips, whatever its exit code, and hide real failures.

usage: no_skip_pattern.py BUILD_DIR
"""
import json
import subprocess
import sys

out = subprocess.run(["ctest", "--show-only=json-v1", "-L", "gpu"], cwd=sys.argv[1], check=True,
                     stdout=subprocess.PIPE, text=True).stdout
tests = json.loads(out)["tests"]
bad = [t["name"] for t in tests
       if any(p["name"] == "SKIP_REGULAR_EXPRESSION" for p in t.get("properties", []))]
if not tests:
    sys.exit("no gpu tests found")
if bad:
    sys.exit("these gpu tests hide failures behind SKIP_REGULAR_EXPRESSION: " + ", ".join(bad))
print(f"ok: {len(tests)} gpu test(s), none with a skip pattern")
