#!/usr/bin/env bash
# usage: expect_exit.sh CODE REGEX -- CMD [ARGS...]
#
# Runs CMD with its stdout and stderr captured together and passes (exits 0) only
# when CMD exits with status CODE and the output matches the extended regular
# expression REGEX. REGEX is matched against the whole output (trailing newlines
# removed) as one string: '^' and '$' anchor its start and end, and newlines are
# ordinary characters. Otherwise prints what differed and exits 1; exits 2 on
# misuse. The output is always echoed, for ctest --output-on-failure.
set -u
if [[ $# -lt 4 || $3 != "--" ]]; then
  echo "usage: expect_exit.sh CODE REGEX -- CMD [ARGS...]" >&2
  exit 2
fi
if ! [[ $1 =~ ^[0-9]+$ ]]; then
  echo "expect_exit.sh: CODE '$1' is not an exit status" >&2
  exit 2
fi
code=$1
regex=$2
shift 3

output=$("$@" 2>&1)
status=$?
printf '$ %q' "$1"; shift_args=("${@:2}"); [[ ${#shift_args[@]} -gt 0 ]] && printf ' %q' "${shift_args[@]}"
printf '\n%s\n[exit status %d]\n' "$output" "$status"

failed=0
if [[ $status -ne $code ]]; then
  echo "FAIL: expected exit status $code, got $status"
  failed=1
fi
if ! [[ $output =~ $regex ]]; then
  echo "FAIL: output does not match /$regex/"
  failed=1
fi
exit $failed
