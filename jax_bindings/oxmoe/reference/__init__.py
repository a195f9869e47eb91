"""Plain-JAX references: each oxmoe op as a JAX user writes it without oxmoe.

:mod:`oxmoe.reference.router`, :mod:`oxmoe.reference.permutation`,
:mod:`oxmoe.reference.grouped_gemm`, :mod:`oxmoe.reference.activation` and
:mod:`oxmoe.reference.moe` compute the semantics of the op of the same name in
``oxmoe`` with ``jax.numpy`` and ``jax.lax`` only (:mod:`oxmoe.reference.fp8`: of the FP8 quantization and grouped
GEMMs): jit-able, differentiable by JAX's autodiff, and written
independently of oxmoe's primitives. The benchmark times oxmoe against them
and checks that both agree; the tests check oxmoe against them where a plain-JAX
formula is what they compare with (the float64 oracles stay in ``tests/``).

Importing this package loads no native code beyond what ``import oxmoe`` loads,
and none of the tools' dependencies (rich, matplotlib, optax).
"""

from oxmoe.reference import activation, fp8, grouped_gemm, moe, permutation, router

__all__ = ["router", "permutation", "grouped_gemm", "activation", "moe", "fp8"]
