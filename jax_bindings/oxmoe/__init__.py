"""oxmoe: fused Mixture-of-Experts primitives for JAX, on CPU and GPU.

Importing the package loads the native library (``$OXMOE_LIBRARY`` or the one
installed inside the package) and registers its XLA FFI handlers.
"""

__version__ = "0.1.0"

from oxmoe import activation, fp8, grouped_gemm, moe, permutation, router
from oxmoe.grouped_gemm import ragged_dot, transposed_ragged_dot
from oxmoe._library import build_id

__all__ = ["activation", "fp8", "grouped_gemm", "moe", "permutation", "router", "ragged_dot", "transposed_ragged_dot", "build_id", "__version__"]
