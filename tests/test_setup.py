"""setup.py builds the CUDA kernels only where they can build, and says why not elsewhere; the
kernels run only on the GPUs they were built for.

Checked against fake toolkits (an nvcc that prints its release, an include folder), with torch's
CUDA version set by the test, so every case runs on any machine.
"""

import pathlib

import pytest
import setuptools
import torch
from torch.utils import cpp_extension

SETUP = pathlib.Path(__file__).resolve().parents[1] / "setup.py"
CUDA_HEADERS = ("cuda_runtime.h", "cuda_fp8.h", "cublasLt.h", "cublas_v2.h", "cusparse.h", "cusolverDn.h")


@pytest.fixture
def setup_py(monkeypatch):
    """setup.py's functions (setuptools.setup itself does nothing here)."""
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    namespace = {"__name__": "setup"}
    exec(compile(SETUP.read_text(), str(SETUP), "exec"), namespace)
    return namespace


def toolkit(root: pathlib.Path, release: str, headers=CUDA_HEADERS) -> str:
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.41'\n")
    nvcc.chmod(0o755)
    (root / "include").mkdir()
    for header in headers:
        (root / "include" / header).touch()
    return str(root)


def decision(setup_py, monkeypatch, torch_cuda, cuda_home):
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cuda_home)
    monkeypatch.delenv("CUDA_INC_PATH", raising=False)
    nvcc = setup_py["nvcc_release"]()
    return nvcc, setup_py["why_no_cuda"](nvcc)


def test_cuda_builds_where_nvcc_matches_torch_and_the_headers_exist(setup_py, monkeypatch, tmp_path):
    nvcc, reason = decision(setup_py, monkeypatch, "13.0", toolkit(tmp_path, "13.1"))
    assert nvcc == (13, 1) and reason is None  # a newer minor release of the same major builds
    assert setup_py["cuda_archs"](nvcc) == [90, 100]
    assert setup_py["cuda_archs"]((12, 4)) == [90]  # no sm_100a before 12.8
    assert setup_py["cuda_arch_flags"]([90, 100]) == ["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_100a,code=sm_100a"]
    (kernels,) = setup_py["extensions"]()
    # the list the extension reports (csrc/bindings.cpp), given to the C++ compiler alone: nvcc would split it at its commas
    assert "-DGRAPHQUANT_CUDA_ARCHS=90,100" in kernels.extra_compile_args["cxx"]
    assert not any("GRAPHQUANT_CUDA_ARCHS" in flag for flag in kernels.extra_compile_args["nvcc"])


@pytest.mark.parametrize(
    "torch_cuda, release, headers, expected",
    [
        (None, "13.0", CUDA_HEADERS, "is not a CUDA build"),
        ("12.8", "13.0", CUDA_HEADERS, "is CUDA 13.0 and torch"),
        ("13.0", "13.0", ("cuda_runtime.h", "cuda_fp8.h"), "cublasLt.h, cublas_v2.h, cusparse.h, cusolverDn.h not found in"),
        ("13.0", None, CUDA_HEADERS, "no nvcc found"),
    ],
    ids=["cpu torch", "nvcc of another major", "no cuBLAS headers", "no nvcc"],
)
def test_elsewhere_the_build_says_why_and_makes_no_extension(setup_py, monkeypatch, tmp_path, capsys, torch_cuda, release, headers, expected):
    home = toolkit(tmp_path, release, headers) if release else str(tmp_path)
    _, reason = decision(setup_py, monkeypatch, torch_cuda, home)
    assert expected in reason
    assert setup_py["extensions"]() == []
    assert f"graphquant: no CUDA kernels (pure Python, reference numerics): {reason}" in capsys.readouterr().out


def test_graphquant_no_cuda_turns_the_kernels_off(setup_py, monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHQUANT_NO_CUDA", "1")
    assert decision(setup_py, monkeypatch, "13.0", toolkit(tmp_path, "13.0")) == ((13, 0), "GRAPHQUANT_NO_CUDA=1")


def test_the_kernels_run_only_on_the_capabilities_they_were_built_for(monkeypatch):
    """Built for sm_90a and sm_100a, arch-specific targets, the extension's kernels run on compute
    capabilities 9.0 and 10.0 alone: on an sm_89, sm_80 or sm_120 GPU graphquant takes the
    reference instead of launching kernels the GPU has no image of; the CPU test build runs
    anywhere."""
    from types import SimpleNamespace

    from graphquant.kernels import devices, native

    built = SimpleNamespace(cuda_built=True, cuda_archs=(90, 100))
    monkeypatch.setattr(native, "extension", lambda: built)
    for capability, runs in (((9, 0), True), ((10, 0), True), ((8, 9), False), ((8, 0), False), ((12, 0), False), ((10, 3), False)):
        devices._of.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, capability=capability: capability)
        assert (native.extension_for(torch.device("cuda", 0)) is built) is runs
    assert native.extension_for(torch.device("cpu")) is None
    emulated = SimpleNamespace(cuda_built=True, emulated=True)
    monkeypatch.setattr(native, "extension", lambda: emulated)
    assert native.extension_for(torch.device("cpu")) is emulated
