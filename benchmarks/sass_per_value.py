"""How many SASS instructions the MXFP8 and NVFP4 decoding programs spend on each weight value,
compiled for sm_90 by Triton on this machine (no GPU needed): at decode sizes the decoding
instructions, not the bytes, set these kernels' pace (benchmarks/NOTES.md, decode_nvfp4.py). The
FP8 decode GEMM's program beside them (its weight tile the autotuner's first, A quantized first or
as it is loaded): whether its loop, not the bytes, could set its pace.

    python benchmarks/sass_per_value.py

For the grouped GEMM's two decoding programs beside the dense decode GEMM's under the same
tiling (triton_decode.experts_gemm): 16-token tiles on the tensor cores (_expert_tiles_kernel,
beside _decode_kernel) and one token a program on the FMA units (_expert_rows_kernel, beside
_fma_kernel): the instructions of the main loop (the
first backward branch's body) a warp a step, per weight value (times the program's lanes, over
the step's BLOCK_N x BLOCK_K weight values), its tensor-core instructions (HGMMA: wgmma;
HMMA: mma.sync) and its shared memory and registers (how many programs fit an SM); the tiles also where K
passes the last whole triton_decode.K_CHUNK (the experts' down projection, K 1408): their steps
inside K unmasked in the main loop, the rest masked in a loop after it. Each compile takes the
hints Triton's JIT gives a launch at the FFN's shapes: pointers, strides and K multiples of 16
(without them FP8 codes would be read a byte at a time).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from tabulate import tabulate

import torch

from graphquant.kernels import triton_decode
from graphquant.quantizers import Float8CurrentScalingQuantizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import ptxas  # noqa: E402  (Triton kernels compiled for Hopper on any machine)

FORMATS = {"mxfp8": triton_decode.LAYOUTS["mxfp8"], "nvfp4": triton_decode.LAYOUTS["nvfp4"]}


def _pointers(layout, pointers: dict) -> dict:
    scale = "*u8" if layout.operand == triton_decode.BF16_VALUES else "*fp8e4nv"
    return {"a_ptr": "*u8", "b_ptr": "*u8", "a_scale_ptr": scale, "b_scale_ptr": scale, **pointers}


def _common(layout, tiling) -> dict:
    return {
        "OPERAND": layout.operand, "ASM": True, "WHOLE_TILES": True, "CHUNK": triton_decode.K_CHUNK, "BLOCK_N": tiling.block_n,
        "BLOCK_K": tiling.block_k, **triton_decode._factors(layout, layout),
    }


_DENSE_POINTERS = {"a_factor_ptr": "*fp32", "b_factor_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32",
                   "arrivals_ptr": "*i32"}
_GROUPED_POINTERS = {"a_factor_ptr": "*fp32", "b_factor_ptr": "*fp32", "out_ptr": "*bf16", "row_group_ptr": "*i64"}


def grouped_tiles(layout) -> tuple:
    tiling = triton_decode.EXPERT_TILING
    constexprs = {**_common(layout, tiling), "SCALE_COLS": layout.scale_block[1], "BLOCK_M": tiling.block_m}
    pointers = _pointers(layout, {**_GROUPED_POINTERS, "source_ptr": "*i64", "ends_ptr": "*i32"})
    return triton_decode._expert_tiles_kernel, constexprs, pointers, tiling


def grouped_tiles_masked(layout) -> tuple:
    kernel, constexprs, pointers, tiling = grouped_tiles(layout)
    return kernel, {**constexprs, "WHOLE_TILES": False}, pointers, tiling


def dense_tiles(layout, tiling=triton_decode.EXPERT_TILING) -> tuple:
    constexprs = {
        **_common(layout, tiling), "SCALE_COLS": layout.scale_block[1], "BLOCK_M": tiling.block_m, "A_SCALE_ROWS": 1, "B_SCALE_ROWS": 1,
        "SPLIT": True, "PROMOTE_EVERY": 128, "MX": 0, "A_FORMAT": "", "B_FORMAT": "", "A_RULE": None, "A_VALUES": False,
        "ONE_DOT": False, "GEMMS": 1, "DEPENDENT": False,
    }
    return triton_decode._decode_kernel, constexprs, _pointers(layout, _DENSE_POINTERS), tiling


def grouped_one_row(layout) -> tuple:
    tiling = triton_decode._ONE_ROW[layout.operand]
    constexprs = {**_common(layout, tiling), "SPLIT": True, "STAGES": tiling.stages}
    pointers = _pointers(layout, {**_GROUPED_POINTERS, "partial_ptr": "*fp32", "arrivals_ptr": "*i32", "position_ptr": "*i64"})
    return triton_decode._expert_rows_kernel, constexprs, pointers, tiling


def dense_one_row(layout) -> tuple:
    tiling = triton_decode._ONE_ROW[layout.operand]
    constexprs = {**_common(layout, tiling), "SPLIT": True, "STAGES": tiling.stages, "GEMMS": 1, "DEPENDENT": False}
    return triton_decode._fma_kernel, constexprs, _pointers(layout, _DENSE_POINTERS), tiling


def fp8_tiles(quantizing_a: bool) -> tuple:
    """The decode GEMM's FP8 program (per-tensor scales) under the autotuner's first weight tile,
    A's codes read, or A's bf16 values quantized as they are loaded (QuantizedOnLoad)."""
    block_n, block_k, warps, stages = triton_decode.AUTOTUNED_TILES[0]
    tiling = triton_decode.DecodeConfig(block_n=block_n, block_k=block_k, warps=warps, stages=stages)
    kernel, constexprs, pointers, tiling = dense_tiles(triton_decode.LAYOUTS["fp8_tensorwise"], tiling)
    rule = None
    if quantizing_a:
        x, quantizer = torch.ones(tiling.block_m, 4096, dtype=torch.bfloat16), Float8CurrentScalingQuantizer("e4m3")
        rule = triton_decode.QuantizedOnLoad(x, triton_decode.amaxes(x, quantizer), quantizer).rule
    codes = {"a_ptr": "*bf16" if quantizing_a else "*fp8e4nv", "b_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32"}
    return kernel, {**constexprs, "WHOLE_TILES": False, "A_RULE": rule, "DEPENDENT": True}, {**pointers, **codes}, tiling


KERNELS = {
    "grouped, 16-token tiles (_expert_tiles_kernel)": grouped_tiles,
    "grouped, 16-token tiles, K past the last whole chunk (masked)": grouped_tiles_masked,
    "dense, 16-row tiles (decode GEMM)": dense_tiles,
    "grouped, one token a program (_expert_rows_kernel)": grouped_one_row,
    "dense, one row (decode GEMM's FMA program)": dense_one_row,
}


FP8_KERNELS = {
    "dense, 16-row tiles (decode GEMM), A's codes": lambda: fp8_tiles(False),
    "dense, 16-row tiles (decode GEMM), A quantized as loaded": lambda: fp8_tiles(True),
}


def sass(kernel, constexprs: dict, pointers: dict, tiling) -> tuple[str, int, int]:
    """The kernel's SASS for sm_90 under ``tiling``, its shared memory in bytes and its registers
    a thread (which set how many programs an SM runs); the arguments later GEMMs of the launch
    would take (``GEMMS``) left None. Strides and K are multiples of 16, as at the FFN's shapes."""
    later_gemms = {p.name: None for p in kernel.params if p.default is None}
    aligned = {name: 4096 for name in kernel.arg_names if name.endswith("_stride") or name == "K"}
    compiled = ptxas.compiled_for(kernel, pointers, aligned, later_gemms | constexprs, tiling.warps, tiling.stages)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        text = subprocess.run([cuobjdump, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    return text, compiled.metadata.shared, int(re.search(r"REG:(\d+)", usage)[1])


def main_loop(text: str) -> collections.Counter:
    """The opcodes of the main loop: the first loop (from a backward branch's target to the
    branch) inside no other; masked tiles run their last steps in a loop after it."""
    instructions = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", text)]
    branches = ((re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text_), address) for address, text_ in instructions)
    loops = [(int(target[1], 16), address) for target, address in branches if target and int(target[1], 16) < address]
    first, last = min(loop for loop in loops if not any(o != loop and o[0] <= loop[0] and loop[1] <= o[1] for o in loops))
    body = [t for a, t in instructions if first <= a <= last]
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)


def main() -> None:
    programs = [(name, kernel_name, lambda make=make, layout=layout: make(layout)) for name, layout in FORMATS.items() for kernel_name, make in KERNELS.items()]
    programs += [("fp8 tensorwise", kernel_name, make) for kernel_name, make in FP8_KERNELS.items()]
    rows = []
    for name, kernel_name, make in programs:
        kernel, constexprs, pointers, tiling = make()
        text, shared, registers = sass(kernel, constexprs, pointers, tiling)
        ops = main_loop(text)
        per_value = sum(ops.values()) * tiling.warps * 32 / (tiling.block_n * tiling.block_k)
        tile = f"{tiling.block_n}x{tiling.block_k}, {tiling.block_m} rows, {tiling.warps} warps, {tiling.stages} stages"
        wgmma = ops["HGMMA"] + ops["QGMMA"]  # QGMMA: FP8 operands
        rows.append([name, kernel_name, tile, sum(ops.values()), f"{per_value:.2f}", wgmma, ops["HMMA"], shared, registers])
    print(f"sm_90, Triton {triton.__version__}")
    headers = ["format", "kernel", "tiling", "loop instructions a warp", "a weight value", "wgmma", "HMMA", "shared bytes", "registers"]
    print(tabulate(rows, headers=headers))


if __name__ == "__main__":
    main()
