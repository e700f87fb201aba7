"""Reference numerics of every format, in plain torch ops that run on any device.

This package is the numerics contract: native kernels are tested bit for bit against it.
Functions here take and return plain tensors (no quantizer objects) and work on 2-D inputs
whose last dimension is the blocked one; callers transpose for columnwise representations.
"""
