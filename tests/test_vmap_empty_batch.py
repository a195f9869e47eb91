"""jax.vmap over an empty batch: every oxmoe primitive gives what plain JAX gives for the same
computation, an empty batch of results (and of gradients) of the right shapes and dtypes.

The batching rule has two paths: a vmapped axis that folds into the token rows (the router
primitives, the combine in a dispatch's backward, the FP8 quantization) and a lax.map over the
batch (aux_loss's sum over tokens, dispatch, the grouped GEMM); the cases below take both. Each oxmoe computation is
compared with a plain-JAX formula of the same values, vmapped the same way; a batch of two
random elements checks that the formula is the computation's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oxmoe import fp8, grouped_gemm, permutation, reference, router

T, E, K, H, N, G = 4, 8, 2, 6, 5, 3
BATCHES = pytest.mark.parametrize("batch", [0, 2], ids=["empty_batch", "batch_of_2"])


def assert_same_batch(actual, expected, *, what, context):
    """The same pytree of arrays: shapes and dtypes, and values (floats to float32 rounding)."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected), f"{what}: {actual!r} vs {expected!r}"
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        where = f"{what}{jax.tree_util.keystr(path)} ({context})"
        assert (a.shape, a.dtype) == (e.shape, e.dtype), f"{where}: {a.dtype}{a.shape}, expected {e.dtype}{e.shape}"
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5, err_msg=where)


def check_vmap(fn, plain, args, in_axes, *, context):
    """vmap of fn, and of the value and gradient of a weighted sum of its float results in its
    float arguments, equal those of plain."""

    def value_and_grad(f):
        def weighted_sum(*a):
            outs = [o for o in jax.tree.leaves(f(*a)) if jnp.issubdtype(o.dtype, jnp.floating)]
            return sum(jnp.sum(o.astype(jnp.float32) * jnp.cos(jnp.arange(o.size).reshape(o.shape))) for o in outs)
        floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
        return jax.value_and_grad(weighted_sum, argnums=floats)

    assert_same_batch(jax.vmap(fn, in_axes)(*args), jax.vmap(plain, in_axes)(*args), what="vmap", context=context)
    assert_same_batch(jax.vmap(value_and_grad(fn), in_axes)(*args), jax.vmap(value_and_grad(plain), in_axes)(*args),
                      what="vmap value_and_grad", context=context)


def normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def topk_maps(rng, *shape):
    """bool [..., T, E]: each token routed to K distinct experts."""
    order = np.argsort(rng.random(shape + (T, E)), axis=-1)
    return jnp.asarray(order < K)


def group_sizes(rng, *shape):
    """int32 [..., G]: sizes summing to at most T."""
    return jnp.asarray(rng.multinomial(T - 1, np.full(G + 1, 1 / (G + 1)), size=shape)[..., :G], jnp.int32)


# ----------------------------------------------------------------- plain-JAX formulas

def plain_topk(logits):
    """(probs, routing_map): softmax over each token's top-k logits."""
    return reference.router.topk(logits, K)


def plain_aux_loss_scores(logits):
    return reference.router.aux_loss_scores(logits, K)


AUX = dict(total_num_tokens=T, topk=K, coeff=0.1)
plain_aux_loss = functools.partial(reference.router.aux_loss, **AUX)


def dispatch(x, routing_map):
    return permutation.dispatch(x, routing_map, topk=K).tokens


def plain_dispatch(x, routing_map):
    """The rows of the routed (token, expert) pairs by expert, then token; zero rows after them."""
    (pair,) = jnp.nonzero(routing_map.T.reshape(-1), size=T * K, fill_value=-1)
    return jnp.where((pair >= 0)[:, None], x[pair % T], 0)


def dispatch_then_combine(x, routing_map, probs):
    d = permutation.dispatch(x, routing_map, topk=K)
    return permutation.combine(d.tokens, d.row_id_map, merging_probs=probs)


def plain_dispatch_then_combine(x, routing_map, probs):
    """Each token's row times the sum of its routed weights."""
    return x * jnp.sum(jnp.where(routing_map, probs, 0), axis=-1, keepdims=True)


def group_mask(sizes, num_rows):
    """[G, M]: whether row m lies in group g (rows past the groups' total lie in none)."""
    group = jnp.sum(jnp.arange(num_rows)[:, None] >= jnp.cumsum(sizes)[None, :], axis=1)
    return (jnp.arange(len(sizes))[:, None] == group[None, :]).astype(jnp.float32)


def plain_ragged_dot(lhs, rhs, sizes):
    """Each row times its group's rhs (jax.lax.ragged_dot has no vmap of its gradient)."""
    return jnp.einsum("gm,mk,gkn->mn", group_mask(sizes, lhs.shape[0]), lhs, rhs, precision="highest")


def plain_transposed_ragged_dot(lhs, rhs, sizes):
    """Per group, lhs_gᵀ · rhs_g."""
    return jnp.einsum("gm,mk,mn->gkn", group_mask(sizes, lhs.shape[0]), lhs, rhs, precision="highest")


def fp8_quantize(block, transpose):
    """oxmoe.fp8.quantize's values (as float32) and scales, and the same of the plain-JAX
    reference."""
    def of(quantize):
        def values_and_scales(x):
            q = quantize(x, block, transpose=transpose)
            return q.values.astype(jnp.float32), q.scales
        return values_and_scales
    return of(fp8.quantize), of(reference.fp8.quantize)


def fp8_quantize_with_transpose(block):
    """oxmoe.fp8.quantize_with_transpose's values (as float32) and scales, both ways, and the
    same of the plain-JAX reference."""
    def of(quantize_with_transpose):
        def values_and_scales(x):
            return tuple((q.values.astype(jnp.float32), q.scales) for q in quantize_with_transpose(x, block))
        return values_and_scales
    return of(fp8.quantize_with_transpose), of(reference.fp8.quantize_with_transpose)


def fp8_requantize(block, transpose):
    """oxmoe.fp8.requantize's values (as float32) and scales of x quantized per row, and the
    same of the plain-JAX reference."""
    def of(requantize):
        def values_and_scales(x):
            q = requantize(fp8.quantize(x), block, dtype=jnp.bfloat16, transpose=transpose)
            return q.values.astype(jnp.float32), q.scales
        return values_and_scales
    return of(fp8.requantize), of(reference.fp8.requantize)


# ---------------------------------------------------------------------------- cases

# name: (oxmoe function, plain-JAX function, (rng, batch) -> (args, in_axes))
CASES = {
    # the fold into token rows
    "topk": (lambda x: router.topk(x, K), plain_topk, lambda rng, b: ((normal(rng, b, T, E),), 0)),
    "topk_batch_second": (lambda x: router.topk(x, K), plain_topk, lambda rng, b: ((normal(rng, T, b, E),), 1)),
    "aux_loss_scores": (lambda x: router.aux_loss_scores(x, K), plain_aux_loss_scores,
                        lambda rng, b: ((normal(rng, b, T, E),), 0)),
    # vmap of a vmap of topk, the batch outside or inside a vmap of 3
    "topk_nested_batch_outer": (jax.vmap(lambda x: router.topk(x, K)), jax.vmap(plain_topk),
                                lambda rng, b: ((normal(rng, b, 3, T, E),), 0)),
    "topk_nested_batch_inner": (jax.vmap(lambda x: router.topk(x, K)), jax.vmap(plain_topk),
                                lambda rng, b: ((normal(rng, 3, b, T, E),), 0)),
    "dispatch": (dispatch, plain_dispatch, lambda rng, b: ((normal(rng, b, T, H), topk_maps(rng, b)), 0)),
    "fp8_quantize": (*fp8_quantize(fp8.ACTIVATION_BLOCK, False), lambda rng, b: ((normal(rng, b, 3, 256),), 0)),
    "fp8_quantize_batch_second": (*fp8_quantize(fp8.TRANSPOSED_ACTIVATION_BLOCK, False),
                                  lambda rng, b: ((normal(rng, 128, b, 256),), 1)),
    "fp8_quantize_transposed": (*fp8_quantize(fp8.WEIGHT_BLOCK, True),
                                lambda rng, b: ((normal(rng, b, 128, 256),), 0)),
    "fp8_quantize_with_transpose": (*fp8_quantize_with_transpose(fp8.ACTIVATION_BLOCK),
                                    lambda rng, b: ((normal(rng, b, 128, 256),), 0)),
    "fp8_requantize_transposed": (*fp8_requantize(fp8.ACTIVATION_BLOCK, True),
                                  lambda rng, b: ((normal(rng, b, 128, 256),), 0)),
    # the lax.map over the batch
    "aux_loss": (functools.partial(router.aux_loss, **AUX), plain_aux_loss,
                 lambda rng, b: ((normal(rng, b, T, E), jnp.asarray(rng.integers(0, T, E), jnp.int32)), (0, None))),
    "aux_loss_batched_counts": (functools.partial(router.aux_loss, **AUX), plain_aux_loss,
                                lambda rng, b: ((normal(rng, b, T, E), jnp.asarray(rng.integers(0, T, (b, E)),
                                                                                    jnp.int32)), 0)),
    "dispatch_then_combine": (dispatch_then_combine, plain_dispatch_then_combine,
                              lambda rng, b: ((normal(rng, b, T, H), topk_maps(rng, b), normal(rng, b, T, E)), 0)),
    "ragged_dot": (grouped_gemm.ragged_dot, plain_ragged_dot,
                   lambda rng, b: ((normal(rng, b, T, H), normal(rng, G, H, N), group_sizes(rng, b)), (0, None, 0))),
    "ragged_dot_batched_rhs": (grouped_gemm.ragged_dot, plain_ragged_dot,
                               lambda rng, b: ((normal(rng, b, T, H), normal(rng, b, G, H, N), group_sizes(rng, b)),
                                               0)),
    "transposed_ragged_dot": (grouped_gemm.transposed_ragged_dot, plain_transposed_ragged_dot,
                              lambda rng, b: ((normal(rng, b, T, H), normal(rng, b, T, N), group_sizes(rng, b)), 0)),
}


@pytest.mark.parametrize("case", CASES)
@BATCHES
def test_vmap_gives_plain_jax_s_batch(case, batch, seed, rng):
    fn, plain, make_args = CASES[case]
    args, in_axes = make_args(rng, batch)
    check_vmap(fn, plain, args, in_axes, context=f"{case}, batch of {batch}, seed={seed}")
