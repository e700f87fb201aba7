"""Each quantizer describes how the native quantize kernels encode it (``kernel_encoding``): a
frozen, printable KernelEncoding that graphquant.kernels.native hands to the extension by name.

The descriptions are pinned here as text, and checked to carry the numbers of the positional
config that native.py built before them (tests/test_kernels_gpu.py checks that the extension reads
those numbers from the names, and that the kernels then make the reference's bits).
"""

import dataclasses

import pytest

from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    Float8RowwiseQuantizer,
    HybridQuantizer,
    IdentityQuantizer,
    KernelEncoding,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

RHT = dict(with_rht=True, with_post_rht_amax=True)

# (quantizer, its rowwise encoding, its columnwise encoding), as printed.
PINNED = [
    (Float8CurrentScalingQuantizer(), "KernelEncoding('tensor', 'e4m3')", "KernelEncoding('tensor', 'e4m3', transposed=True)"),
    (
        Float8CurrentScalingQuantizer(fp8_dtype="e5m2", force_pow_2_scales=True, amax_epsilon=1e-3),
        "KernelEncoding('tensor', 'e5m2', amax_epsilon=0.001, pow2_scales=True)",
        "KernelEncoding('tensor', 'e5m2', transposed=True, amax_epsilon=0.001, pow2_scales=True)",
    ),
    (
        Float8DelayedScalingQuantizer(fp8_dtype="e5m2", margin=2),
        "KernelEncoding('tensor', 'e5m2', delayed_scaling=True)",
        "KernelEncoding('tensor', 'e5m2', transposed=True, delayed_scaling=True)",
    ),
    (
        Float8BlockQuantizer(block_scaling_dim=1),
        "KernelEncoding('block', 'e4m3', block=(1, 128), pow2_scales=True)",
        "KernelEncoding('block', 'e4m3', block=(128, 1), transposed=True, pow2_scales=True)",
    ),
    (
        Float8BlockQuantizer(fp8_dtype="e5m2", force_pow_2_scales=False, amax_epsilon=0.5),
        "KernelEncoding('block', 'e5m2', block=(128, 128), amax_epsilon=0.5)",
        "KernelEncoding('block', 'e5m2', block=(128, 128), transposed=True, amax_epsilon=0.5)",
    ),
    (
        Float8RowwiseQuantizer(),
        "KernelEncoding('row', 'e4m3', block=(1, -1), pow2_scales=True)",
        "KernelEncoding('row', 'e4m3', block=(-1, 1), transposed=True, pow2_scales=True)",
    ),
    (
        Float8RowwiseQuantizer(fp8_dtype="e5m2", force_pow_2_scales=False),
        "KernelEncoding('row', 'e5m2', block=(1, -1))",
        "KernelEncoding('row', 'e5m2', block=(-1, 1), transposed=True)",
    ),
    (MXFP8Quantizer(), "KernelEncoding('mxfp8', 'e4m3', block=(1, 32))", "KernelEncoding('mxfp8', 'e4m3', block=(32, 1))"),
    (MXFP8Quantizer(fp8_dtype="e5m2"), "KernelEncoding('mxfp8', 'e5m2', block=(1, 32))", "KernelEncoding('mxfp8', 'e5m2', block=(32, 1))"),
    (NVFP4Quantizer(), "KernelEncoding('nvfp4', 'e2m1', block=(1, 16))", "KernelEncoding('nvfp4', 'e2m1', block=(16, 1), transposed=True)"),
    (
        NVFP4Quantizer(with_2d_quantization=True),
        "KernelEncoding('nvfp4', 'e2m1', block=(16, 16))",
        "KernelEncoding('nvfp4', 'e2m1', block=(16, 16), transposed=True)",
    ),
    (
        NVFP4Quantizer(**RHT, stochastic_rounding=True, row_scaled_nvfp4=True),
        "KernelEncoding('nvfp4', 'e2m1', block=(1, 16), stochastic_rounding=True, row_scaled=True)",
        "KernelEncoding('nvfp4', 'e2m1', block=(16, 1), transposed=True, hadamard=True, random_sign_mask=True, stochastic_rounding=True)",
    ),
    (
        NVFP4Quantizer(**RHT, with_random_sign_mask=False, with_2d_quantization=True),
        "KernelEncoding('nvfp4', 'e2m1', block=(16, 16))",
        "KernelEncoding('nvfp4', 'e2m1', block=(16, 16), transposed=True, hadamard=True)",
    ),
    (NVFP4Quantizer(with_amax_reduction=True), "KernelEncoding('nvfp4', 'e2m1', block=(1, 16))", "KernelEncoding('nvfp4', 'e2m1', block=(16, 1), transposed=True)"),
    (IdentityQuantizer(), "None", "None"),
    (
        HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(**RHT), "rowwise_dequantized"),
        "KernelEncoding('mxfp8', 'e4m3', block=(1, 32))",
        "KernelEncoding('nvfp4', 'e2m1', block=(16, 1), transposed=True, hadamard=True, random_sign_mask=True)",
    ),
    (
        HybridQuantizer(Float8BlockQuantizer(block_scaling_dim=1), IdentityQuantizer()),
        "KernelEncoding('block', 'e4m3', block=(1, 128), pow2_scales=True)",
        "None",
    ),
]


@pytest.mark.parametrize("quantizer, rowwise, columnwise", PINNED, ids=[str(q) for q, _, _ in PINNED])
def test_every_built_in_quantizer_describes_its_kernel_encoding(quantizer, rowwise, columnwise):
    for direction, expected in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)):
        encoding = quantizer.kernel_encoding(direction)
        assert repr(encoding) == expected, direction
        if encoding is not None:
            assert eval(repr(encoding)) == encoding and hash(encoding) == hash(eval(repr(encoding)))
            with pytest.raises(dataclasses.FrozenInstanceError):
                encoding.scaling = "block"
            child = quantizer.child(direction)
            assert encoding.transposed == child.transposed(direction) and encoding.hadamard == child.hadamard(direction)
            assert encoding.block == child.block(direction)


def old_config(quantizer, direction):
    """The positional config graphquant/kernels/native.py built before KernelEncoding, its last
    entry (the per-call stochastic-rounding key) aside: [format, fp8, epsilon, pow2, two_d, rht,
    sign_mask, sr, row_scaled], with csrc/cuda/params.h's format codes; None for the reference."""
    q = quantizer.child(direction)
    if isinstance(q, Float8CurrentScalingQuantizer):
        return [1, {"e4m3": 0, "e5m2": 1}[q.fp8_dtype], q.amax_epsilon, int(q.force_pow_2_scales), 0, 0, 0, 0, 0]
    if isinstance(q, Float8DelayedScalingQuantizer):
        return [1, {"e4m3": 0, "e5m2": 1}[q.fp8_dtype], 0, 0, 0, 0, 0, 0, 0]
    if isinstance(q, (Float8BlockQuantizer, Float8RowwiseQuantizer)):
        fmt = 2 if isinstance(q, Float8BlockQuantizer) else 3
        two_d = int(fmt == 2 and q.block_scaling_dim == 2)
        return [fmt, {"e4m3": 0, "e5m2": 1}[q.fp8_dtype], q.amax_epsilon, int(q.force_pow_2_scales), two_d, 0, 0, 0, 0]
    if isinstance(q, MXFP8Quantizer):
        return [4, {"e4m3": 0, "e5m2": 1}[q.fp8_dtype], 0, 0, 0, 0, 0, 0, 0]
    if isinstance(q, NVFP4Quantizer):
        columnwise = direction == COLUMNWISE
        return [
            5, 0, 0, 0, int(q.with_2d_quantization), int(q.hadamard(direction)), int(q.with_random_sign_mask),
            int(q.stochastic_rounding), int(q.row_scaled_nvfp4 and not columnwise),
        ]
    return None


def comparable(config):
    """``config`` with the sign mask counted only under the transform: the old config passed
    with_random_sign_mask on every NVFP4 side, and the kernels read it only where rht is set."""
    if config is None:
        return None
    config = list(config)
    config[6] = config[6] if config[5] else 0
    return config


def positions(encoding):
    """The old config's numbers as an encoding names them."""
    if encoding is None:
        return None
    rows, cols = encoding.block
    return [
        {"tensor": 1, "block": 2, "row": 3, "mxfp8": 4, "nvfp4": 5}[encoding.scaling],
        {"e4m3": 0, "e5m2": 1, "e2m1": 0}[encoding.element],
        encoding.amax_epsilon,
        int(encoding.pow2_scales),
        int(rows == cols > 1),
        int(encoding.hadamard),
        int(encoding.random_sign_mask),
        int(encoding.stochastic_rounding),
        int(encoding.row_scaled),
    ]


@pytest.mark.parametrize("quantizer", [q for q, _, _ in PINNED], ids=[str(q) for q, _, _ in PINNED])
def test_the_encoding_carries_the_numbers_of_the_old_positional_config(quantizer):
    for direction in (ROWWISE, COLUMNWISE):
        assert positions(quantizer.kernel_encoding(direction)) == comparable(old_config(quantizer, direction)), direction


@pytest.mark.parametrize(
    "fields, complaint",
    [
        (dict(scaling="tile", element="e4m3"), "scaling must be one of"),
        (dict(scaling="block", element="e2m1", block=(1, 128)), "encodes e4m3 or e5m2 elements"),
        (dict(scaling="nvfp4", element="e4m3", block=(1, 16)), "encodes e2m1 elements"),
        (dict(scaling="block", element="e4m3", block=(1, 48)), "blocks of"),
        (dict(scaling="block", element="e4m3", block=(1, 256)), "blocks of"),
        (dict(scaling="block", element="e4m3", block=(64, 64)), "blocks of"),
        (dict(scaling="mxfp8", element="e4m3", block=(1, 16)), "blocks of"),
        (dict(scaling="block", element="e4m3", block=(1, 128), delayed_scaling=True), "delayed_scaling is per-tensor"),
        (dict(scaling="mxfp8", element="e4m3", block=(1, 32), pow2_scales=True), "has its own scale rule"),
        (dict(scaling="tensor", element="e4m3", stochastic_rounding=True), "are NVFP4's"),
        (dict(scaling="nvfp4", element="e2m1", block=(16, 1), random_sign_mask=True), "set hadamard too"),
    ],
)
def test_an_encoding_no_kernel_runs_is_refused_when_made(fields, complaint):
    with pytest.raises(ValueError, match=complaint):
        KernelEncoding(**fields)
