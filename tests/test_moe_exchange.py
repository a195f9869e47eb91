"""The bytes the expert-parallel layer puts on the wire, read from the optimized HLO of its
training step (forward and backward) compiled for the host's CPU devices, at EP 2, 4 and 8 with
the routing, hidden size and FFN size of real models and fresh random tokens.

The layer's exchange sends each token once to each shard that owns any of its experts, in one
all_to_all whose slot size is chosen on the device from a ladder of static sizes (one branch of an
HLO conditional per size; one static size and no conditional where nearly every token goes to
every shard). So the test:

- routes the tokens with the layer's own router on the mesh and counts, in NumPy, the routed
  rows (token, expert copies) and the (token, shard) pairs each shard sends each other;
- takes from the HLO every all-to-all, and of each conditional only the branch whose slot holds
  the largest (source, destination) block, and sums their elements (XLA:CPU sends bfloat16 as
  float32; the count is at the layer's dtype, as a GPU sends it);
- checks that the four exchanges of a step carry at most 1.25x the routed rows' bytes, that
  no other collective carries token rows, and that the layer chose that slot size at run time.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import compiled_steps
import devices
from oxmoe import model_shapes, moe
from oxmoe.moe import MoEConfig, MoEParams
from oxmoe.moe.exchange import SLOT_STEP, cost_model, shards_per_token, slot_sizes

# (router, tokens per shard, hidden, ffn, expert shards)
CASES = {
    "deepseek_v3_ep2": (model_shapes.DEEPSEEK_V3, 2048, 7168, 2048, 2),
    "deepseek_v3_ep4": (model_shapes.DEEPSEEK_V3, 2048, 7168, 2048, 4),
    "deepseek_v3_ep8": (model_shapes.DEEPSEEK_V3, 2048, 7168, 2048, 8),
    "qwen3_ep8": (model_shapes.QWEN3_MOE, 2048, 2048, 768, 8),
    "mixtral_ep8": (model_shapes.MIXTRAL, 4096, 4096, 14336, 8),
}
EXCHANGES_PER_STEP = 4  # tokens out and back in the forward, their gradients in the backward
WIRE_GOAL = 1.25

_SHAPE = re.compile(r"(bf16|f16|f32|s32|pred|u8|s8|f64|s64|u32)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_COLLECTIVE = re.compile(r"= (.*?) (all-to-all|all-gather|reduce-scatter|collective-permute|all-reduce)"
                         r"(?:-start)?\(")


@dataclasses.dataclass
class Collective:
    kind: str
    shapes: list  # the result's array shapes (an all-to-all's equal its operands')
    computation: str
    dtypes: list  # their element types, as HLO names them


def collectives_of(hlo: str) -> tuple[list[Collective], list[list[str]]]:
    """Every collective of the module with the computation it sits in, and every
    conditional's branch computations in order."""
    found, conditionals, computation = [], [], None
    for line in hlo.splitlines():
        stripped = line.strip()
        header = _COMPUTATION.match(stripped)
        if header and "=" not in stripped.split("{")[0].split("->")[0].split("(")[0]:
            computation = header.group(1)
            continue
        match = _COLLECTIVE.search(stripped)
        if match and not stripped.startswith("ROOT %tuple"):
            arrays = _SHAPE.findall(match.group(1))
            shapes = [tuple(int(d) for d in dims.split(",") if d) for _, dims in arrays]
            found.append(Collective(match.group(2), shapes, computation, [dtype for dtype, _ in arrays]))
        if " conditional(" in stripped:
            branches = re.search(r"branch_computations=\{([^}]*)\}", stripped)
            conditionals.append([b.strip().lstrip("%") for b in branches.group(1).split(",")])
    return found, conditionals


def route_on_mesh(x, gate, bias, config, mesh):
    """Each shard's routing map and the slot size its exchange chose, by the layer's own steps."""
    def per_shard(x, gate, bias):
        params = MoEParams(gate, None, None, bias)
        routing = moe.route(x, params, config, expert_axis="expert")
        exchange = moe.dispatch(x, routing, config, expert_axis="expert").exchange
        slot = jnp.asarray(exchange.slot_rows, jnp.int32)[exchange.slot_choice]
        return routing.routing_map, slot[None]

    return jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P("expert"), P(), None if bias is None else P()),
                                 out_specs=(P("expert"), P("expert"))))(x, gate, bias)


@pytest.mark.parametrize("case", CASES)
def test_exchange_bytes_are_the_routed_rows(case, seed, rng):
    router, tokens, hidden, ffn, shards = CASES[case]
    config = MoEConfig(**router.moe_kwargs(), exchange="all_to_all")
    e, el = config.num_experts, config.num_experts // shards
    mesh = jax.make_mesh((shards,), ("expert",), devices=devices.cpu_devices()[:shards],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(jnp.asarray(rng.standard_normal((shards * tokens, hidden)), jnp.bfloat16),
                       NamedSharding(mesh, P("expert")))
    gate = jnp.asarray(rng.standard_normal((hidden, e)) / math.sqrt(hidden), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(e) * 0.01, jnp.float32) if config.use_expert_bias else None
    context = f"{case}, seed={seed}"

    routing_map, chosen = route_on_mesh(x, gate, bias, config, mesh)
    per_shard = np.asarray(routing_map).reshape(shards, tokens, shards, el)
    routed_rows = per_shard.sum() / shards  # (token, expert) copies a shard sends, on average
    blocks = per_shard.any(-1).sum(1)  # blocks[s, j]: tokens shard s sends shard j
    pairs = blocks.sum() / shards

    # The training step's optimized HLO, its parameters abstract (no expert weights allocated).
    hlo = compiled_steps.compiled_step(config, mesh, x, compiled_steps.abstract_params(config, mesh, hidden, ffn)
                                       ).as_text()
    found, conditionals = collectives_of(hlo)
    in_branches = [c for c in found if c.kind == "all-to-all" and any(c.computation in b for b in conditionals)]
    single = len(slot_sizes(tokens, shards, config)) == 1
    assert (not in_branches) == single, f"{context}: one static slot size: {single}, all-to-alls in branches: " \
                                        f"{len(in_branches)}"

    largest = int(blocks.max())
    branch_of = {name: (i, b) for i, branches in enumerate(conditionals) for b, name in enumerate(branches)}
    # Each conditional's branch that runs: the one whose all-to-all slot is the smallest holding `largest`.
    slot_of_branch = {}
    for c in found:
        if c.kind == "all-to-all" and c.computation in branch_of:
            slot_of_branch[c.computation] = c.shapes[0][-2]
    runs = {}
    for i, branches in enumerate(conditionals):
        fits = [b for b in branches if slot_of_branch.get(b, -1) >= largest]
        if fits:
            runs[i] = min(fits, key=slot_of_branch.__getitem__)
    executed = [c for c in found if c.computation not in branch_of or runs.get(branch_of[c.computation][0]) ==
                c.computation]

    row_elements = weight_elements = other_bytes = 0
    for c in executed:
        elements = sum(math.prod(s) for s in c.shapes)
        if c.kind == "all-to-all" and c.shapes[0][-1] == hidden:
            row_elements += elements
        elif c.kind == "all-to-all" and c.shapes[0][-1] == el:
            weight_elements += elements
        elif c.kind != "all-reduce":  # all-reduces sum the replicated gate's gradient and the losses
            assert hidden not in c.shapes[0], f"{context}: a {c.kind} of {c.shapes} carries token rows"
            other_bytes += 4 * sum(math.prod(s) for s in c.shapes)
    slot = int(np.asarray(chosen).reshape(-1)[0])
    assert (np.asarray(chosen) == slot).all(), f"{context}: the shards chose different slot sizes {chosen}"
    expected = min(slot_of_branch[b] for b in slot_of_branch if slot_of_branch[b] >= largest) \
        if slot_of_branch else tokens
    assert slot == expected, f"{context}: the layer chose slots of {slot} rows, the smallest holding {largest} " \
                             f"is {expected}"

    row_bytes = hidden * jnp.dtype(config.dtype).itemsize
    wire = (row_elements * jnp.dtype(config.dtype).itemsize + weight_elements * 4 + other_bytes) / EXCHANGES_PER_STEP
    assert row_elements == EXCHANGES_PER_STEP * shards * slot * hidden, \
        f"{context}: {row_elements} token-row elements in the step's all-to-alls, expected 4 of {shards}x{slot}x{hidden}"
    ratio, pair_ratio = wire / (routed_rows * row_bytes), wire / (pairs * row_bytes)
    print(f"{case}: {wire / 2**20:.1f} MiB per exchange per shard; {ratio:.3f}x the routed rows "
          f"({routed_rows:.0f}), {pair_ratio:.3f}x the (token, shard) pairs ({pairs:.0f}); slot {slot} rows for "
          f"a largest block of {largest}")
    assert ratio <= WIRE_GOAL, f"{context}: {ratio:.3f}x the routed rows' bytes on the wire"
    # The cost model's shards per token, against this routing's.
    np.testing.assert_allclose(pairs / tokens, shards_per_token(config, shards), rtol=0.03, err_msg=context)


# (model shape, tokens per shard, expert shards, the exchange "auto" must choose). The EP = 2
# choices against what bench/ep_steps.py measured on two H200s (bench/RESULTS.md, 2026-11-29,
# steps back to back): at DeepSeek-V3's and Qwen3's top-8 routing the all_to_all has one static
# slot of every token, sends what the ring's gather sends and copies it into its slots and
# back, and the ring was faster (38.8 against 40.8 ms, 9.65 against 9.82 ms); at Mixtral 8x7B's
# top-2 of 8 the all_to_all was faster (136.0 against 139.6 ms), as its fewer bytes say. Past
# EP = 2 the ring moves every token to every shard, (n - 1) T rows, against about
# shards_per_token(n) T of the (token, shard) pairs.
AUTO_CASES = {
    "deepseek_v3_ep2": (model_shapes.DEEPSEEK_V3_LAYER, 8192, 2, "ring"),
    "qwen3_ep2": (model_shapes.QWEN3_30B_A3B_LAYER, 16384, 2, "ring"),
    "mixtral_8x7b_ep2": (model_shapes.MIXTRAL_8X7B_LAYER, 32768, 2, "all_to_all"),
    "deepseek_v3_ep8": (model_shapes.DEEPSEEK_V3_LAYER, 8192, 8, "all_to_all"),
    "qwen3_ep8": (model_shapes.QWEN3_30B_A3B_LAYER, 16384, 8, "all_to_all"),
    "mixtral_ep8": (model_shapes.MIXTRAL_LAYER, 32768, 8, "all_to_all"),
}


@pytest.mark.parametrize("case", AUTO_CASES)
def test_auto_chooses_the_exchange_measured_fastest(case):
    shape, tokens, shards, expected = AUTO_CASES[case]
    config = MoEConfig(**shape.router.moe_kwargs())
    mesh = jax.make_mesh((shards,), ("expert",), devices=devices.cpu_devices()[:shards],
                         axis_types=(jax.sharding.AxisType.Auto,))
    chosen = {}

    def per_shard(x, gate, bias):
        params = MoEParams(gate, None, None, bias)
        routing = moe.route(x, params, config, expert_axis="expert")
        d = moe.dispatch(x, routing, config, expert_axis="expert")
        chosen["method"] = "ring" if d.ring else d.exchange.method
        return x

    bias = jax.ShapeDtypeStruct((config.num_experts,), jnp.float32) if config.use_expert_bias else None
    jax.eval_shape(jax.shard_map(per_shard, mesh=mesh, in_specs=(P("expert"), P(), None if bias is None else P()),
                                 out_specs=P("expert")),
                   jax.ShapeDtypeStruct((shards * tokens, shape.hidden), jnp.bfloat16),
                   jax.ShapeDtypeStruct((shape.hidden, config.num_experts), jnp.float32), bias)
    costs = cost_model(config, shards, tokens, shape.hidden)
    # Its ring bytes: (n - 1) T rows in each of four collectives, the weights' gather and their
    # gradients' reduce-scatter (float32 [T, E] each).
    row = shape.hidden * 2
    assert costs["ring"] == 4 * (shards - 1) * tokens * row + 2 * (shards - 1) * tokens * config.num_experts * 4
    assert chosen["method"] == expected, f"{case}: auto chose {chosen['method']}, costs {costs}"


# (router, tokens per shard, shards, one static slot size?): at EP 2 with top-8 nearly every
# token goes to both shards (98.6% at DeepSeek-V3's groups, 99.6% at Qwen3), so the ladder
# keeps only its largest size; Mixtral's top-2 of 8 sends 79% of the tokens to the other
# shard at EP 2, DeepSeek-V3 50% to each of the others at EP 8: a ladder.
LADDER_CASES = {
    "deepseek_v3_ep2": (model_shapes.DEEPSEEK_V3, 8192, 2, True),
    "qwen3_ep2": (model_shapes.QWEN3_MOE, 16384, 2, True),
    "mixtral_ep2": (model_shapes.MIXTRAL, 32768, 2, False),
    "deepseek_v3_ep8": (model_shapes.DEEPSEEK_V3, 8192, 8, False),
}


@pytest.mark.parametrize("case", LADDER_CASES)
def test_the_slot_ladder_is_one_size_where_the_balanced_block_is_nearly_all_tokens(case):
    router, tokens, shards, single = LADDER_CASES[case]
    config = MoEConfig(**router.moe_kwargs())
    ladder = slot_sizes(tokens, shards, config)
    balanced = tokens * shards_per_token(config, shards) / shards
    assert ladder[-1] == tokens and (len(ladder) == 1) == single, (case, ladder, balanced)
    assert (balanced * SLOT_STEP >= tokens) == single, case
    if not single:
        # Each size at most SLOT_STEP above the next (before rounding up to 8 rows), from half
        # the balanced block to every token.
        assert all(b <= math.ceil(a * SLOT_STEP / 8) * 8 + 8 for a, b in zip(ladder, ladder[1:])), (case, ladder)
        assert ladder[0] <= balanced / 2 + 8 and list(ladder) == sorted(set(ladder)), (case, ladder)
    # A capacity caps the largest block: the ladder starts there.
    capped = slot_sizes(tokens, shards, config, largest=tokens // 4)
    assert capped[-1] == tokens // 4 and len(capped) <= len(ladder) + 1, (case, capped)


# No capacity: slots of T rows; 0.05: each of a shard's 128 experts takes 2 copies, so no shard
# receives more than 256 of another's 512 tokens: slots of 256.
@pytest.mark.parametrize("capacity_factor", [None, 0.05])
def test_one_static_slot_lays_each_shards_tokens_out_in_its_slot(capacity_factor, rng):
    """With one static slot size S, shard j's tokens start at row j * S of the layout the
    all_to_all sends as it is, in token order; the rows past a shard's tokens hold none."""
    shards, tokens, hidden = 2, 512, 256
    config = MoEConfig(**model_shapes.DEEPSEEK_V3.moe_kwargs(), exchange="all_to_all",
                       capacity_factor=capacity_factor)
    mesh = jax.make_mesh((shards,), ("expert",), devices=devices.cpu_devices()[:shards],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(jnp.asarray(rng.standard_normal((shards * tokens, hidden)), jnp.bfloat16),
                       NamedSharding(mesh, P("expert")))
    gate = jnp.asarray(rng.standard_normal((hidden, config.num_experts)) / math.sqrt(hidden), jnp.float32)
    bias = jnp.zeros(config.num_experts, jnp.float32)

    def per_shard(x, gate, bias):
        routing = moe.route(x, MoEParams(gate, None, None, bias), config, expert_axis="expert")
        exchange = moe.dispatch(x, routing, config, expert_axis="expert").exchange
        assert exchange.in_slots, exchange.slot_rows
        return routing.dispatched()[0], exchange.token_rows.dest_rows, exchange.token_rows.source_tokens

    maps, dest, source = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P("expert"), P(), P()),
                                               out_specs=(P("expert"),) * 3))(x, gate, bias)
    capacity = config.expert_capacity(shards * tokens)
    (slot,) = slot_sizes(tokens, shards, config, None if capacity is None else config.num_experts // shards * capacity)
    assert slot == (tokens if capacity is None else 256)
    dest, source = np.asarray(dest).reshape(shards, tokens, shards), np.asarray(source).reshape(shards, shards, slot)
    goes = np.asarray(maps).reshape(shards, tokens, shards, -1).any(-1)
    for s in range(shards):
        for j in range(shards):
            sent = np.flatnonzero(goes[s, :, j])
            context = f"shard {s} to shard {j}, capacity_factor {capacity_factor}"
            np.testing.assert_array_equal(source[s, j, :len(sent)], sent, context)
            assert (source[s, j, len(sent):] == -1).all(), context
            expected = np.full(tokens, -1)
            expected[sent] = j * slot + np.arange(len(sent))
            np.testing.assert_array_equal(dest[s, :, j], expected, context)


# --------------------------------------------------------------------- token chunks

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")


def entry_dependencies(hlo: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """The entry computation's instructions (name -> the text after '='), and each one's
    transitive operands among them."""
    body, instructions = False, {}
    for line in hlo.splitlines():
        if line.startswith("ENTRY "):
            body = True
            continue
        if body and line.startswith("}"):
            break
        match = _INSTRUCTION.match(line) if body else None
        if match:
            instructions[match.group(1)] = match.group(2)
    operands = {name: {ref for ref in re.findall(r"%([\w.\-]+)", text) if ref in instructions and ref != name}
                for name, text in instructions.items()}
    closure: dict[str, set[str]] = {}

    def depends(name):
        if name not in closure:
            closure[name] = set()
            for op in operands[name]:
                closure[name] |= {op} | depends(op)
        return closure[name]

    for name in instructions:
        depends(name)
    return instructions, closure


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_each_token_chunk_travels_waiting_only_for_its_own_expert_gemms(chunks):
    """With token_chunks C, the compiled training step (EP 2, one static slot: no
    conditional) exchanges token rows 4 C times, and each exchange waits for no expert GEMM
    of another chunk of its pass, so XLA may run chunk c + 1's exchange under chunk c's
    GEMMs. Counted per exchange, (forward GEMMs, backward GEMMs) it depends on, where the
    forward's are oxmoe_ragged_dot_activation and oxmoe_ragged_dot (the up and down projections)
    and the backward's oxmoe_ragged_dot's rhs-transposed form (2 C each):

    - the tokens out: (0, 0), C times;
    - their results back: (2, 0), each after its own chunk's two;
    - the output's gradient out: (2 C, 0): it is computed from y, but waits for no
      backward GEMM;
    - the tokens' gradient back: (2 C, 2), each after its own chunk's two backward GEMMs.
    """
    hidden, ffn, tokens = 192, 96, 256  # hidden: no other collective's rows are 192 wide
    config = MoEConfig(**model_shapes.QWEN3_MOE.moe_kwargs(), exchange="all_to_all", token_chunks=chunks)
    mesh = jax.make_mesh((2,), ("expert",), devices=devices.cpu_devices()[:2],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.ShapeDtypeStruct((2 * tokens, hidden), jnp.bfloat16, sharding=NamedSharding(mesh, P("expert")))
    hlo = compiled_steps.compiled_step(config, mesh, x, compiled_steps.abstract_params(config, mesh, hidden, ffn)
                                       ).as_text()
    instructions, closure = entry_dependencies(hlo)
    gemms = {name: "rhs_transposed = true" in text for name, text in instructions.items()
             if re.search(r'custom_call_target="oxmoe_ragged_dot(_activation)?"', text)}
    forward = {g for g, transposed in gemms.items() if not transposed}
    backward = {g for g, transposed in gemms.items() if transposed}
    assert len(forward) == len(backward) == 2 * chunks, (len(forward), len(backward))
    exchanges = [name for name, text in instructions.items()
                 if " all-to-all(" in text and re.match(rf"\(?(f32|bf16)\[\d+,\d+,{hidden}\]", text)]
    waits = sorted((len(closure[e] & forward), len(closure[e] & backward)) for e in exchanges)
    c = chunks
    assert waits == sorted([(0, 0)] * c + [(2, 0)] * c + [(2 * c, 0)] * c + [(2 * c, 2)] * c), waits
