"""benchmarks/ab.sh: one command on the tree (A) and on the tree with a patch (B), in alternating
rounds, the tree as it was afterwards."""

import os
import subprocess

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "ab.sh")


def test_alternating_rounds_on_both_versions_and_the_tree_restored(tmp_path):
    tree, out = tmp_path / "tree", tmp_path / "out"
    tree.mkdir()
    (tree / "version.txt").write_text("A\n")
    (tmp_path / "b.patch").write_text("--- a/version.txt\n+++ b/version.txt\n@@ -1 +1 @@\n-A\n+B\n")
    done = subprocess.run(
        ["bash", SCRIPT, str(tmp_path / "b.patch"), "3", "cat", "version.txt"],
        cwd=tree, env={**os.environ, "OUT": str(out)}, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    runs = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("== ")]
    assert runs == ["A", "B", "B", "A", "A", "B"], done.stdout
    assert all((out / f"ab_{v}_{r}.txt").read_text() == f"{v}\n" for v in "AB" for r in (1, 2, 3))
    assert (tree / "version.txt").read_text() == "A\n"


def test_a_patch_that_does_not_apply_is_refused(tmp_path):
    (tmp_path / "version.txt").write_text("C\n")
    (tmp_path / "b.patch").write_text("--- a/version.txt\n+++ b/version.txt\n@@ -1 +1 @@\n-A\n+B\n")
    done = subprocess.run(["bash", SCRIPT, "b.patch", "1", "true"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "does not apply" in done.stderr
    assert (tmp_path / "version.txt").read_text() == "C\n"
