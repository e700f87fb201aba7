"""A kernel that stores what the decode GEMM makes of a high-precision A as it loads it
(triton_decode._quantized_words: MXFP8's or NVFP4's words and scales), for tests to compare with
the reference quantizers. Imported only where Triton is installed."""

import triton
import triton.language as tl

from graphquant.kernels import triton_decode


@triton.jit
def words_kernel(x_ptr, amax_ptr, codes_ptr, scale_ptr, ROWS: tl.constexpr, WORDS: tl.constexpr, OPERAND: tl.constexpr, RULE: tl.constexpr):
    """x (ROWS, K) contiguous -> codes (ROWS, WORDS) int64 and scale (ROWS, WORDS) fp32: each
    word's block's E8M0 exponent (MXFP8, OPERAND 1) or E4M3 scale (NVFP4, under the amax of each
    row at amax_ptr)."""
    row = tl.arange(0, ROWS)[:, None, None]
    if OPERAND == 1:  # (rows, blocks, a block's 4 words)
        word = tl.arange(0, WORDS // 4)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
        codes, biased = triton_decode._quantized_words(x_ptr, row, ROWS, word, WORDS * 8, WORDS * 8, None, 1, RULE)
        scale = tl.broadcast_to(biased, codes.shape).to(tl.float32)
    else:
        word = tl.arange(0, WORDS)[None, :, None]
        codes, scale = triton_decode._quantized_words(x_ptr, row, ROWS, word, WORDS * 16, WORDS * 16, tl.load(amax_ptr + row), 2, RULE)
    tl.store(codes_ptr + row * WORDS + word, codes)
    tl.store(scale_ptr + row * WORDS + word, scale.to(tl.float32))
