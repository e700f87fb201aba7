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


def test_a_kernel_patch_runs_b_in_a_copy_with_its_own_build(tmp_path):
    """A patch that changes csrc/ runs B in a copy of the tree (B_TREE) with the patch applied and
    the extension built there first (setup.py build_ext --inplace; a stand-in here), A in the tree
    as it is, which the run leaves as it was."""
    tree, copy, out = tmp_path / "tree", tmp_path / "b", tmp_path / "out"
    (tree / "csrc").mkdir(parents=True)
    (tree / "csrc" / "kernel.cu").write_text("A\n")
    (tree / "setup.py").write_text("import sys\nassert sys.argv[1:] == ['build_ext', '--inplace']\nopen('built.txt', 'w').write('built\\n')\n")
    (tmp_path / "b.patch").write_text("diff --git a/csrc/kernel.cu b/csrc/kernel.cu\n--- a/csrc/kernel.cu\n+++ b/csrc/kernel.cu\n@@ -1 +1 @@\n-A\n+B\n")
    done = subprocess.run(
        ["bash", SCRIPT, str(tmp_path / "b.patch"), "2", "sh", "-c", "cat csrc/kernel.cu; cat built.txt 2>/dev/null || echo none"],
        cwd=tree, env={**os.environ, "OUT": str(out), "B_TREE": str(copy)}, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert all((out / f"ab_A_{r}.txt").read_text() == "A\nnone\n" for r in (1, 2))
    assert all((out / f"ab_B_{r}.txt").read_text() == "B\nbuilt\n" for r in (1, 2))
    assert (tree / "csrc" / "kernel.cu").read_text() == "A\n" and not (tree / "built.txt").exists()
