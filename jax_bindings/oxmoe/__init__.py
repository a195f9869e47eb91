"""oxmoe: fused Mixture-of-Experts primitives for JAX, on CPU and GPU.

Importing the package loads the native library (``$OXMOE_LIBRARY`` or the one
installed inside the package) and registers its XLA FFI handlers.
"""

__version__ = "0.1.0"

from oxmoe import permutation, router
from oxmoe._library import build_id

__all__ = ["permutation", "router", "build_id", "__version__"]
