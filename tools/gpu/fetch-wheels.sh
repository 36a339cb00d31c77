#!/usr/bin/env bash
# Downloads the wheels of tools/gpu/wheels.txt (cp312, manylinux x86_64, no dependencies) into
# .whl/ at the repository root (ignored by git). Run on a machine with a package index.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
grep -v '^\s*#' tools/gpu/wheels.txt | grep -v '^\s*$' | while read -r requirement; do
  python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    -d .whl "$requirement"
done
ls -1 .whl
du -sh .whl
