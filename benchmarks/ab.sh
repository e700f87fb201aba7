#!/usr/bin/env bash
# One benchmark command on two versions of the tree, one process at a time in alternating rounds
# (A B, B A, A B, ...), so that the GPU's drift between processes falls on both alike: A is the tree
# as it is, B the tree with PATCH applied (undone after each B, and on exit). Make PATCH where git
# has both versions, e.g. `git diff HEAD main -- graphquant > ab.patch` for main's Python files as B
# (the GPU machine's copy of the tree has no history to diff against). Each process's output goes
# to $OUT/ab_<version>_<round>.txt, and its last TAIL lines (default 20) to stdout.
#   bash benchmarks/ab.sh PATCH ROUNDS COMMAND...
set -uo pipefail
if [ $# -lt 3 ]; then echo "usage: bash benchmarks/ab.sh PATCH ROUNDS COMMAND..." >&2; exit 2; fi
patch=$(realpath "$1") rounds=$2; shift 2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
apply() { git apply "$@" "$patch" 2>/dev/null || patch -s -p1 "$@" < "$patch"; }
applies() { git apply --check "$patch" 2>/dev/null || patch -s -p1 --dry-run < "$patch" > /dev/null; }
applied=0
undo() { if [ $applied = 1 ]; then apply -R && applied=0; fi; }
trap undo EXIT
applies || { echo "ab.sh: $patch does not apply to this tree" >&2; exit 1; }
for ((round = 1; round <= rounds; round++)); do
  order="A B"; [ $((round % 2)) = 0 ] && order="B A"
  for version in $order; do
    if [ $version = B ]; then apply && applied=1; fi
    echo "== $version (round $round): $*"
    "$@" > "$OUT/ab_${version}_$round.txt" 2>&1
    echo "   exit $?"
    tail -n "${TAIL:-20}" "$OUT/ab_${version}_$round.txt"
    undo
  done
done
