"""benchmarks/attention_ab.py's baseline copies (its timing needs a GPU)."""

import importlib
import sys

from benchmark_tables import BENCHMARKS


def test_a_baseline_copy_loads_as_a_module_of_its_own(tmp_path, monkeypatch):
    """A copy whose dataclass looks its module up at definition (annotations postponed, as in
    graphquant's modules) loads under its own name, beside the module it copies; a folder without
    the copy gives None."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    attention_ab = importlib.import_module("attention_ab")
    source = ("from __future__ import annotations\n\nimport dataclasses\n\n\n"
              "@dataclasses.dataclass(frozen=True)\nclass Config:\n    stages: int = 4\n")
    (tmp_path / "gluon_attention.py").write_text(source)
    module = attention_ab.baseline_module(str(tmp_path), "gluon_attention")
    assert module.__name__ == "baseline_gluon_attention" and sys.modules[module.__name__] is module
    assert module.Config().stages == 4
    assert attention_ab.baseline_module(str(tmp_path), "gluon_attention_backward") is None
