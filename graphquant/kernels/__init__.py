"""Where the numbers are made: the native extension's and Triton's kernels, the GEMM backends,
and the exact emulation of the GEMMs a device does not run.

    native       quantize and dequantize on graphquant._C's kernels, the reference where it has none
    backends     which GEMM multiplies a pair of representations on a device, and running it
    scaled_mm    the native GEMMs: cuBLASLt through torch._scaled_mm and graphquant._C
    emulation    dequantize exactly, multiply in high precision
    triton_*     CUDA kernels in Triton: the exact scale ops, the byte transpose, the emulated
                 GEMM's dequantize (imported only where Triton exists)

Kernels know no pass and no op: graphquant.ops registers the Triton kernels as the CUDA
implementations of its ops.
"""
