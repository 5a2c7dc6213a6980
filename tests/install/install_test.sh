#!/usr/bin/env bash
# cmake --install puts libraries, headers and a package config in a prefix; an outside CMake
# project finds them with find_package(dtrain), links dtrain::engine and runs.
# usage: install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/tests/install/consumer" -B "$work/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/consumer" >/dev/null
out=$("$work/consumer/consumer")
echo "$out"
[[ $out == "dtrain 0.1.0: sum 4" ]]
