#!/usr/bin/env bash
# One benchmark command on two versions of the tree, one process at a time in alternating rounds
# (A B, B A, A B, ...), so that the GPU's drift between processes falls on both alike: A is the tree
# as it is, B the tree with PATCH applied (undone after each B, and on exit). Make PATCH where git
# has both versions, e.g. `git diff HEAD main -- graphquant > ab.patch` for main's Python files as B
# (the GPU machine's copy of the tree has no history to diff against). A PATCH that changes csrc/
# needs an extension of its own: B then runs in a copy of the tree (B_TREE, default /tmp/ab_b) with
# PATCH applied and the extension built in place (about as long as gpu.sh's build; its log in
# $OUT/ab_build.log), A in the tree as built. Each process's output goes to
# $OUT/ab_<version>_<round>.txt, and its last TAIL lines (default 20) to stdout.
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
b_tree=""
if grep -q '^diff --git a/csrc/' "$patch"; then
  b_tree=${B_TREE:-/tmp/ab_b}
  rm -rf "$b_tree" && mkdir -p "$b_tree"
  tar -C . --exclude=./build --exclude=./.whl --exclude='*.so' -cf - . | tar -C "$b_tree" -xf -
  (cd "$b_tree" && patch -s -p1 < "$patch" && python3 setup.py build_ext --inplace > "$OUT/ab_build.log" 2>&1) \
    || { echo "ab.sh: B's extension did not build ($OUT/ab_build.log)" >&2; exit 1; }
fi
run_b() { if [ -n "$b_tree" ]; then (cd "$b_tree" && PYTHONPATH="$b_tree${PYTHONPATH:+:$PYTHONPATH}" "$@"); else apply && applied=1 && "$@"; fi; }
for ((round = 1; round <= rounds; round++)); do
  order="A B"; [ $((round % 2)) = 0 ] && order="B A"
  for version in $order; do
    echo "== $version (round $round): $*"
    if [ $version = B ]; then run_b "$@"; else "$@"; fi > "$OUT/ab_${version}_$round.txt" 2>&1
    echo "   exit $?"
    tail -n "${TAIL:-20}" "$OUT/ab_${version}_$round.txt"
    undo
  done
done
