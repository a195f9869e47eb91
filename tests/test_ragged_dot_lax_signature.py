"""oxmoe.ragged_dot takes what jax.lax.ragged_dot takes, with its meaning: the same
parameters in the same order, positional or by keyword; int64 and NumPy group sizes;
mixed operand dtypes, promoted as lax promotes them; any float preferred_element_type;
a precision (which changes nothing: the kernels accumulate in float32 always). Each call
is compared with jax.lax.ragged_dot on the CPU, in dtype and in value, and with a float64
NumPy product at the precision of its result dtype."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oxmoe import grouped_gemm

M, K, N, G = 11, 6, 5, 4
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
# The tolerance of a result of each dtype: summed in float32, then rounded once to it.
TOLERANCE = {jnp.dtype(F32): 1e-5, jnp.dtype(BF16): 2e-2, jnp.dtype(F16): 2e-3}


def operands(rng, lhs_dtype, rhs_dtype):
    lhs = jnp.asarray(rng.normal(size=(M, K)), lhs_dtype)
    rhs = jnp.asarray(rng.normal(size=(G, K, N)), rhs_dtype)
    return lhs, rhs, np.asarray([3, 0, 5, 2], np.int32)


def assert_close(actual, desired, dtype):
    tolerance = TOLERANCE[jnp.dtype(dtype)]
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(desired, np.float64),
                               rtol=tolerance, atol=tolerance * 4)


def check_like_lax(ours, theirs, operand_dtype=F32):
    """Same dtype and shape as lax, and the same values within the coarser of the result's
    and the operands' precision: XLA:CPU may round its product to the operands' promoted
    dtype before converting (bfloat16 operands with a float16 result come out bfloat16-exact)."""
    assert ours.dtype == theirs.dtype, (ours.dtype, theirs.dtype)
    assert ours.shape == theirs.shape
    coarser = max(ours.dtype, jnp.dtype(operand_dtype), key=lambda d: jnp.finfo(d).eps)
    assert_close(ours, theirs, coarser)


def lax_on_cpu(*args, **kwargs):
    """jax.lax.ragged_dot on the CPU: on a GPU its float32 product defaults to TF32."""
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.lax.ragged_dot(*args, **kwargs)


def float64_ragged_dot(lhs, rhs, sizes):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for group, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        out[start:end] = lhs[start:end] @ rhs[group]
    return out


def test_the_parameters_are_lax_s_in_lax_s_order():
    lax_params = list(inspect.signature(jax.lax.ragged_dot).parameters)
    ours = inspect.signature(grouped_gemm.ragged_dot).parameters
    assert list(ours)[:len(lax_params)] == lax_params
    assert all(ours[name].default is None for name in lax_params[3:])
    extra = [name for name in ours if name not in lax_params]
    assert extra == ["rhs_transposed", "zero_unused_rows"]
    assert all(ours[name].kind is inspect.Parameter.KEYWORD_ONLY for name in extra)


# name: (lhs dtype, rhs dtype, positional arguments after group_sizes, keyword arguments)
CALLS = {
    "positional_precision_and_preferred": (BF16, BF16, (jax.lax.Precision.HIGHEST, F32), {}),
    "keyword_precision": (F32, F32, (), dict(precision="highest")),
    "precision_pair": (F32, F32, (), dict(precision=(jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST))),
    "out_sharding_none": (F32, F32, (), dict(out_sharding=None)),
    "bf16_lhs_f32_rhs": (BF16, F32, (), {}),
    "f32_lhs_bf16_rhs": (F32, BF16, (), {}),
    "f16_lhs_bf16_rhs": (F16, BF16, (), {}),
    "preferred_f16_from_bf16": (BF16, BF16, (), dict(preferred_element_type=F16)),
    "preferred_bf16_from_f32": (F32, F32, (), dict(preferred_element_type=BF16)),
    "preferred_f32_from_mixed": (BF16, F16, (None, F32), {}),
}


@pytest.mark.parametrize("call", CALLS)
def test_a_call_lax_accepts_gives_lax_s_result(call, rng):
    lhs_dtype, rhs_dtype, args, kwargs = CALLS[call]
    lhs, rhs, sizes = operands(rng, lhs_dtype, rhs_dtype)
    ours = grouped_gemm.ragged_dot(lhs, rhs, sizes, *args, **kwargs)
    check_like_lax(ours, lax_on_cpu(lhs, rhs, sizes, *args, **kwargs),
                   jnp.result_type(lhs, rhs))
    assert_close(ours, float64_ragged_dot(lhs, rhs, sizes), ours.dtype)


@pytest.mark.parametrize("sizes_of", [lambda s: np.asarray(s, np.int64), lambda s: np.asarray(s, np.uint8),
                                      lambda s: jnp.asarray(s, jnp.int16), lambda s: np.asarray(s, np.int32)],
                         ids=["numpy_int64", "numpy_uint8", "jax_int16", "numpy_int32"])
def test_integer_group_sizes_of_any_dtype_are_cast_to_int32(sizes_of, rng):
    lhs, rhs, sizes = operands(rng, F32, F32)
    expected = lax_on_cpu(lhs, rhs, sizes_of(sizes))
    check_like_lax(grouped_gemm.ragged_dot(lhs, rhs, sizes_of(sizes)), expected)
    check_like_lax(jax.jit(grouped_gemm.ragged_dot)(lhs, rhs, sizes_of(sizes)), expected)


def test_int64_group_sizes_under_x64_are_cast_to_int32():
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        lhs, rhs, sizes = operands(rng, F32, F32)
        sizes = jnp.asarray(sizes, jnp.int64)
        assert sizes.dtype == jnp.int64
        expected = lax_on_cpu(lhs, rhs, sizes)
        check_like_lax(grouped_gemm.ragged_dot(lhs, rhs, sizes), expected)
        check_like_lax(jax.jit(grouped_gemm.ragged_dot)(lhs, rhs, sizes), expected)


def test_a_group_size_outside_int32_raises_naming_group_sizes():
    lhs, rhs, _ = operands(np.random.default_rng(0), F32, F32)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_gemm.ragged_dot(lhs, rhs, np.asarray([2, 2**40, 0, 0], np.int64))


def test_gradients_of_mixed_operands_are_lax_s(rng):
    lhs, rhs, sizes = operands(rng, BF16, F32)

    def loss(dot):
        return lambda lhs, rhs: jnp.sum(dot(lhs, rhs, sizes) * jnp.arange(N, dtype=F32))

    ours = jax.grad(loss(grouped_gemm.ragged_dot), (0, 1))(lhs, rhs)
    theirs = jax.grad(loss(jax.lax.ragged_dot), (0, 1))(lhs, rhs)
    for a, b in zip(ours, theirs):
        check_like_lax(a, b)
