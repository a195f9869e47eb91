"""Trains a small decoder-only MoE language model with oxmoe on Shakespeare.

    python -m oxmoe.train [--steps N] [--experts E] [--topk K] [--routing softmax|sigmoid] ...

A byte-level transformer whose feed-forward layers are oxmoe.nnx.MoE blocks
learns to continue eight of Shakespeare's plays, which ship inside the package
(oxmoe/data/shakespeare; no download). It runs on JAX's default backend (the
GPU when there is one, else the CPU) with expert parallelism over the devices
(--devices; on the CPU that many virtual devices): each device holds
experts / devices of each layer's experts and routes its share of the batch.

--micro-batches N accumulates gradients: each step's batch runs as N
micro-batches, their gradients averaged for one optimiser update (with --fp8,
the expert weights quantized once a step for all of them).

A progress bar shows the training loss, tokens/s and the load balance (the
busiest expert's tokens over the mean, worst layer). At the end it writes, to
--out: loss.png (training and validation loss against the unigram baseline:
the entropy of the validation text's own byte frequencies, the best any model
without context can do), expert_share.png (each layer's share of routed tokens
per expert) and summary.json (the configuration and every number shown).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.resources
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

#: What the job needs beyond oxmoe itself, and how to get it.
TOOLS_HINT = "pip install 'oxmoe[tools]' (flax, optax, rich and matplotlib)"

try:
    import optax
    from flax import nnx
except ModuleNotFoundError as missing:
    if __name__ == "__main__":
        sys.exit(f"python -m oxmoe.train needs {missing.name}: {TOOLS_HINT}")
    raise ModuleNotFoundError(f"oxmoe.train needs {missing.name}: {TOOLS_HINT}", name=missing.name) from missing

import oxmoe
from oxmoe import fp8
from oxmoe._progress import Progress
from oxmoe.moe import MoEConfig
from oxmoe.nnx import MoE

VOCAB = 256  # bytes
EXPERT_AXIS = "expert"
#: Logical axis rules of the MoE blocks' parameters: the experts split over the mesh.
AXIS_RULES = (("exp", EXPERT_AXIS), ("embed", None), ("mlp", None))
#: The fraction of each play (its end) held out for validation.
VALIDATION_FRACTION = 0.1


# --- data ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Corpus:
    """The training and validation bytes (uint8) of the shipped plays."""

    train: np.ndarray
    validation: np.ndarray
    sources: tuple[str, ...]


def load_corpus() -> Corpus:
    """Reads the plays shipped in ``oxmoe/data/shakespeare``; the last tenth of each is validation."""
    folder = importlib.resources.files("oxmoe") / "data" / "shakespeare"
    plays = sorted((p for p in folder.iterdir() if p.name.endswith(".txt")), key=lambda p: p.name)
    if not plays:
        raise FileNotFoundError(f"no plays in {folder}: the oxmoe package was installed without its data")
    train, validation = [], []
    for play in plays:
        text = np.frombuffer(play.read_bytes(), np.uint8)
        cut = int(len(text) * (1 - VALIDATION_FRACTION))
        train.append(text[:cut])
        validation.append(text[cut:])
    return Corpus(np.concatenate(train), np.concatenate(validation), tuple(p.name for p in plays))


def unigram_entropy(data: np.ndarray) -> float:
    """The entropy in nats of ``data``'s own byte frequencies: the loss of the best context-free model."""
    counts = np.bincount(data, minlength=VOCAB).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def sample_windows(data: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """``batch`` random windows of ``length + 1`` consecutive bytes (inputs and next-byte targets)."""
    starts = rng.integers(0, len(data) - length - 1, size=batch)
    return np.stack([data[s:s + length + 1] for s in starts]).astype(np.int32)


# --- the model ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The language model's sizes and its MoE layers' routing and compute dtype."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    seq_len: int
    moe: MoEConfig


class CausalAttention(nnx.Module):
    """Multi-head causal self-attention (no biases)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.heads = config.heads
        self.qkv = nnx.Linear(config.hidden, 3 * config.hidden, use_bias=False, dtype=config.moe.dtype, rngs=rngs)
        self.out = nnx.Linear(config.hidden, config.hidden, use_bias=False, dtype=config.moe.dtype, rngs=rngs)

    def __call__(self, x):
        b, s, h = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, s, 3 * self.heads, h // self.heads), 3, axis=2)
        return self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, h))


class Block(nnx.Module):
    """A pre-norm transformer block whose feed-forward layer is an oxmoe MoE."""

    def __init__(self, config: ModelConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs):
        dtype = config.moe.dtype
        self.attention_norm = nnx.RMSNorm(config.hidden, dtype=dtype, rngs=rngs)
        self.attention = CausalAttention(config, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(config.hidden, dtype=dtype, rngs=rngs)
        self.moe = MoE(config.moe, config.hidden, config.ffn, rngs=rngs, expert_axis=EXPERT_AXIS, mesh=mesh)

    def __call__(self, x, fp8_weights=None):
        x = x + self.attention(self.attention_norm(x))
        y, aux = self.moe(self.moe_norm(x), fp8_weights=fp8_weights)
        return x + y.astype(x.dtype), aux


class MoELanguageModel(nnx.Module):
    """Byte embeddings plus learned positions, ``layers`` blocks, a final norm, and the
    embedding's transpose as the output layer."""

    def __init__(self, config: ModelConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs):
        dtype = config.moe.dtype
        self.embed = nnx.Embed(VOCAB, config.hidden, dtype=dtype, rngs=rngs)
        self.positions = nnx.Embed(config.seq_len, config.hidden, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(config, mesh, rngs=rngs) for _ in range(config.layers)])
        self.final_norm = nnx.RMSNorm(config.hidden, dtype=dtype, rngs=rngs)

    def __call__(self, tokens, fp8_weights=None):
        """Next-byte logits ``[B, S, 256]`` (float32) and each block's :class:`oxmoe.moe.MoEAux`;
        ``fp8_weights``: each block's expert weights quantized (``quantize_expert_weights``), or ``None``."""
        x = self.embed(tokens) + self.positions(jnp.arange(tokens.shape[1]))
        auxes = []
        for block, weights in zip(self.blocks, fp8_weights or [None] * len(self.blocks)):
            x, aux = block(x, weights)
            auxes.append(aux)
        return self.embed.attend(self.final_norm(x)).astype(jnp.float32), auxes


def next_byte_loss(logits, targets):
    """Mean cross-entropy in nats."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def create_model(config: ModelConfig, mesh: jax.sharding.Mesh, seed: int, optimizer: optax.GradientTransformation
                 ) -> tuple[MoELanguageModel, nnx.Optimizer]:
    """The model and its optimiser, with the experts (and their optimiser state) split over the
    mesh's expert axis and everything else replicated."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(AXIS_RULES):
        model = MoELanguageModel(config, mesh, rngs=nnx.Rngs(seed))
        state = nnx.state(model)
        nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
        return model, nnx.Optimizer(model, optimizer, wrt=nnx.Param)


@nnx.jit(static_argnames="micro_batches")
def train_step(model: MoELanguageModel, optimizer: nnx.Optimizer, windows, bias_rate, micro_batches: int = 1):
    """One optimiser step on ``windows [B, S + 1]``; returns the next-byte loss, the MoE
    losses (already times their coefficients) and each layer's tokens per expert ``[L, E]``.

    With ``micro_batches`` N > 1 (gradient accumulation), the step's gradient is the mean of
    the gradients of N micro-batches of B / N windows (windows i, i + N, i + 2N, ...: each
    device's share of the batch splits without moving), computed one after another, so only
    one micro-batch's activations are alive at a time; the losses are their means, the
    tokens per expert their sums. With FP8 experts, each block's expert weights are
    quantized once for the step's micro-batches, not in each of them (the same bits)."""
    graph, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]  # two filters: three parts
    fp8_weights = ([block.moe.quantize_expert_weights() for block in model.blocks]
                   if model.blocks[0].moe.config.fp8 is not None else None)

    def gradients(batch):
        def loss(params):
            logits, auxes = nnx.merge(graph, params, rest)(batch[:, :-1], fp8_weights)
            byte_loss = next_byte_loss(logits, batch[:, 1:])
            moe_loss = sum(aux.load_balancing_loss + aux.z_loss for aux in auxes)
            return byte_loss + moe_loss, (byte_loss, moe_loss, jnp.stack([aux.tokens_per_expert for aux in auxes]))
        (_, results), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return grads, results

    batch, length = windows.shape
    micro = jnp.moveaxis(windows.reshape(batch // micro_batches, micro_batches, length), 1, 0)

    def accumulate(total, batch):
        grads, results = gradients(batch)
        return jax.tree.map(jnp.add, total, grads), results

    # One micro-batch: XLA removes the loop of one trip (checked in the CPU program, whose losses are
    # those of the step without it, bit for bit).
    grads, (byte_losses, moe_losses, counts) = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), micro)
    grads = jax.tree.map(lambda g: g / micro_batches, grads)
    byte_loss, moe_loss, tokens_per_expert = byte_losses.mean(), moe_losses.mean(), counts.sum(0)
    optimizer.update(model, grads)
    for block, counts in zip(model.blocks, tokens_per_expert):
        if block.moe.expert_bias is not None:
            block.moe.update_expert_bias(counts, bias_rate)
    return byte_loss, moe_loss, tokens_per_expert


@nnx.jit
def validation_loss(model: MoELanguageModel, windows):
    """The mean next-byte loss on ``windows [N, B, S + 1]``, one batch at a time."""
    def batch_loss(total, batch):
        logits, _ = model(batch[:, :-1])
        return total + next_byte_loss(logits, batch[:, 1:]), None
    total, _ = jax.lax.scan(batch_loss, jnp.float32(0), windows)
    return total / windows.shape[0]


# --- the run ------------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: a bad flag exits with argparse's usage and the reason."""
    parser = argparse.ArgumentParser(prog="python -m oxmoe.train", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model size")
    model.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    model.add_argument("--hidden", type=int, default=128, help="hidden size H (default 128)")
    model.add_argument("--heads", type=int, default=4, help="attention heads; must divide H (default 4)")
    model.add_argument("--ffn", type=int, default=128, help="each expert's SwiGLU size F (default 128)")
    model.add_argument("--seq-len", type=int, default=128, help="bytes of context (default 128)")
    moe = parser.add_argument_group("experts and routing")
    moe.add_argument("--experts", type=int, default=8, help="experts per MoE layer (default 8)")
    moe.add_argument("--topk", type=int, default=2, help="experts per token (default 2)")
    moe.add_argument("--routing", choices=("softmax", "sigmoid"), default="softmax",
                     help="softmax: Mixtral / Qwen3 (softmax over the top-k logits, balanced by the aux loss); "
                          "sigmoid: DeepSeek-V3 (sigmoid scores normalised over the top-k, balanced by an expert "
                          "bias moved after every step, no aux loss by default) (default softmax)")
    moe.add_argument("--groups", type=int, default=None,
                     help="group-limited routing: experts form this many groups (default: none)")
    moe.add_argument("--group-topk", type=int, default=None, help="with --groups: groups a token may use")
    moe.add_argument("--aux-loss-coeff", type=float, default=None,
                     help="load-balancing loss coefficient (default 1e-2 with softmax, 0 with sigmoid)")
    moe.add_argument("--z-loss-coeff", type=float, default=1e-3, help="router z-loss coefficient (default 1e-3)")
    moe.add_argument("--bias-rate", type=float, default=1e-3,
                     help="sigmoid routing: the expert bias update rate (default 1e-3)")
    moe.add_argument("--shared-experts", type=int, default=0,
                     help="shared experts every token goes through, each of width --ffn, as MaxText's "
                          "shared_experts (MoEConfig.shared_ffn = this x --ffn) (default 0)")
    run = parser.add_argument_group("training")
    run.add_argument("--steps", type=int, default=300, help="optimiser steps (default 300)")
    run.add_argument("--batch", type=int, default=32,
                     help="sequences per step; a multiple of --devices x --micro-batches (default 32)")
    run.add_argument("--micro-batches", type=int, default=1,
                     help="split each step's batch into this many micro-batches, run one after another, their "
                          "gradients averaged for one update (gradient accumulation; with --fp8 the expert "
                          "weights are quantized once a step); default 1")
    run.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                     help="compute dtype (default bfloat16 on a GPU, float32 on the CPU)")
    run.add_argument("--fp8", action="store_true",
                     help="the experts' GEMMs in block-scaled FP8 (MoEConfig.fp8 = oxmoe.fp8.BlockScaling(), "
                          "DeepSeek-V3's recipe); --hidden and --ffn must be multiples of 128")
    run.add_argument("--fp8-square-gradients", action="store_true",
                     help="with --fp8: the weight gradients take the output gradients in 128 x 128 blocks "
                          "(BlockScaling(square_gradient_blocks=True): faster weight gradients, coarser scales)")
    run.add_argument("--devices", type=int, default=None,
                     help="devices for expert parallelism; must divide --experts and --batch (default: every "
                          "GPU; on the CPU, 2 virtual devices)")
    run.add_argument("--eval-every", type=int, default=50, help="steps between validation losses (default 50)")
    run.add_argument("--seed", type=int, default=0, help="random seed of the weights and batches (default 0)")
    run.add_argument("--out", type=pathlib.Path, default=pathlib.Path("oxmoe-train"),
                     help="folder for loss.png, expert_share.png and summary.json (default ./oxmoe-train)")
    args = parser.parse_args(argv)
    for name in ("layers", "hidden", "heads", "ffn", "seq_len", "experts", "topk", "steps", "batch", "micro_batches",
                 "eval_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.hidden % args.heads:
        parser.error(f"--heads {args.heads} must divide --hidden {args.hidden}")
    if args.shared_experts < 0:
        parser.error(f"--shared-experts must be at least 0, got {args.shared_experts}")
    if args.devices is not None and args.devices < 1:
        parser.error(f"--devices must be at least 1, got {args.devices}")
    if args.fp8_square_gradients and not args.fp8:
        parser.error("--fp8-square-gradients is an option of --fp8's recipe: give --fp8 too")
    if args.fp8 and (args.hidden % 128 or args.ffn % 128):
        parser.error(f"--fp8 needs --hidden and --ffn multiples of 128 (one scale per 128), got {args.hidden} and "
                     f"{args.ffn}")
    return args


def make_mesh(requested: int | None, num_experts: int, batch: int, micro_batches: int = 1) -> jax.sharding.Mesh:
    """A one-axis mesh of the devices that hold the experts and split each micro-batch."""
    available = jax.devices()
    count = requested or len(available)
    # The flags' own consistency first: it does not depend on the machine.
    if num_experts % count:
        raise SystemExit(f"--experts {num_experts} is not a multiple of the {count} devices the experts are split "
                         "over (set --devices)")
    if batch % (count * micro_batches):
        split = f"{count} devices the experts are split over"
        raise SystemExit(f"--batch {batch} is not a multiple of the {split} (set --devices)" if micro_batches == 1 else
                         f"--batch {batch} is not a multiple of --micro-batches {micro_batches} times the {split}")
    if count > len(available):
        raise SystemExit(f"--devices {count}: only {len(available)} {available[0].platform} device(s) here")
    return jax.make_mesh((count,), (EXPERT_AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=available[:count])


def moe_config(args, dtype) -> MoEConfig:
    """The MoE blocks' configuration from the routing flags (sigmoid routing: the expert bias)."""
    sigmoid = args.routing == "sigmoid"
    aux = args.aux_loss_coeff if args.aux_loss_coeff is not None else 0.0 if sigmoid else 1e-2
    try:
        return MoEConfig(num_experts=args.experts, topk=args.topk, score_function=args.routing,
                         num_groups=args.groups, group_topk=args.group_topk, use_expert_bias=sigmoid,
                         aux_loss_coeff=aux, z_loss_coeff=args.z_loss_coeff, dtype=dtype,
                         shared_ffn=args.shared_experts * args.ffn or None,
                         fp8=fp8.BlockScaling(square_gradient_blocks=args.fp8_square_gradients) if args.fp8 else None)
    except (ValueError, TypeError) as error:
        raise SystemExit(f"bad routing options: {error}") from None


def imbalance(tokens_per_expert: np.ndarray) -> np.ndarray:
    """Per layer, the busiest expert's tokens over the mean (1 is perfectly balanced)."""
    counts = tokens_per_expert.astype(np.float64)
    return counts.max(-1) / np.maximum(counts.mean(-1), 1e-9)


def parameter_counts(model: MoELanguageModel, config: ModelConfig) -> tuple[int, int]:
    """The parameters in all, and those a token uses (its top-k experts of each layer)."""
    total = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    expert_weights = sum(block.moe.up.size + block.moe.down.size for block in model.blocks)
    unused = expert_weights * (config.moe.num_experts - config.moe.topk) // config.moe.num_experts
    return int(total), int(total - unused)


def train(args: argparse.Namespace) -> dict:
    """Trains as ``args`` say, shows progress, writes the plots and the summary; returns the summary."""
    platform = jax.devices()[0].platform
    dtype = jnp.dtype(args.dtype or ("bfloat16" if platform == "gpu" else "float32"))
    mesh = make_mesh(args.devices, args.experts, args.batch, args.micro_batches)
    config = ModelConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, ffn=args.ffn,
                         seq_len=args.seq_len, moe=moe_config(args, dtype))
    corpus = load_corpus()
    baseline = unigram_entropy(corpus.validation)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup_steps=max(1, args.steps // 10),
                                                  decay_steps=args.steps, end_value=args.lr / 10)
    model, optimizer = create_model(config, mesh, args.seed, optax.adamw(schedule, b2=0.99, weight_decay=0.1))
    total_params, active_params = parameter_counts(model, config)

    rng = np.random.default_rng(args.seed)
    batch_sharding = jax.NamedSharding(mesh, jax.P(EXPERT_AXIS))
    validation = jax.device_put(
        np.stack([sample_windows(corpus.validation, rng, args.batch, args.seq_len) for _ in range(8)]),
        jax.NamedSharding(mesh, jax.P(None, EXPERT_AXIS)))
    tokens_per_step = args.batch * args.seq_len
    device = jax.devices()[0]
    log_every = max(1, args.steps // 20)  # without a live bar: a line every 5% of the steps
    losses, moe_losses, step_seconds = [], [], []
    tokens_per_expert = np.zeros((args.steps, args.layers, args.experts), np.int64)
    validation_losses = []  # (step, loss)

    with Progress(args.steps, "steps") as progress:
        progress.log(f"oxmoe {oxmoe.build_id()}: {config.layers} blocks, H={config.hidden}, {args.experts} experts "
                     f"(top-{args.topk}, {args.routing}) of F={config.ffn} over {mesh.size} {device.device_kind} "
                     f"device(s), {total_params / 1e6:.2f}M parameters ({active_params / 1e6:.2f}M per token), "
                     f"{dtype.name}{', FP8 experts' if args.fp8 else ''}"
                     f"{f', {args.micro_batches} micro-batches a step' if args.micro_batches > 1 else ''}; "
                     f"{len(corpus.train) / 1e6:.2f} MB of "
                     "Shakespeare, unigram baseline "
                     f"{baseline:.3f} nats/byte")
        progress.running("compiling")
        clock = time.perf_counter()

        def evaluate(step):
            nonlocal clock
            validation_losses.append((step, float(validation_loss(model, validation))))
            clock = time.perf_counter()  # the evaluation is not training time

        def record(step, result):
            """Reads the step's numbers (timing it); ``show`` reports them."""
            nonlocal clock
            byte_loss, moe_loss, counts = jax.device_get(result)
            now = time.perf_counter()
            step_seconds.append(now - clock)
            clock = now
            losses.append(float(byte_loss))
            moe_losses.append(float(moe_loss))
            tokens_per_expert[step] = counts

        def show(step):
            recent = slice(max(1, len(step_seconds) - 20), None)  # the first step compiles
            rate = tokens_per_step / np.mean(step_seconds[recent]) if len(step_seconds) > 1 else 0.0
            # The validation loss is measured every --eval-every steps: shown with the step it was measured at.
            val_step, val = validation_losses[-1]
            stats = (f"loss {np.mean(losses[-10:]):.3f}  val {val:.3f} @ step {val_step} (unigram {baseline:.3f})  "
                     f"{rate / 1e3:.1f}k tok/s  load max/mean {imbalance(tokens_per_expert[step]).max():.2f}")
            progress.running(stats)
            progress.advance()
            if not progress.live and ((step + 1) % log_every == 0 or step + 1 == args.steps):
                progress.log(f"step {step + 1}/{args.steps}  {stats}")

        evaluate(0)
        pending = None  # the previous step's result, read after the next step is queued
        bias_rate = jnp.float32(args.bias_rate)
        # Walks the module graph once, not every step.
        step_model = functools.partial(nnx.cached_partial(train_step, model, optimizer),
                                       micro_batches=args.micro_batches)
        for step in range(args.steps):
            windows = jax.device_put(sample_windows(corpus.train, rng, args.batch, args.seq_len), batch_sharding)
            result = step_model(windows, bias_rate)
            if pending is not None:
                record(*pending)
                show(pending[0])
            pending = (step, result)
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                record(*pending)
                pending = None
                evaluate(step + 1)
                show(step)  # after the evaluation: the line shows the validation loss of this step

    tail = slice(-max(1, args.steps // 10), None)
    steady_seconds = sum(step_seconds[1:])
    summary = dict(
        command="python -m oxmoe.train " + " ".join(sys.argv[1:]), oxmoe=oxmoe.build_id(), jax=jax.__version__,
        device=device.device_kind, platform=platform, devices=mesh.size,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        data=dict(sources=list(corpus.sources), train_bytes=len(corpus.train),
                  validation_bytes=len(corpus.validation), unigram_baseline=baseline),
        model=dict(layers=config.layers, hidden=config.hidden, heads=config.heads, ffn=config.ffn,
                   seq_len=config.seq_len, experts=args.experts, topk=args.topk, shared_experts=args.shared_experts,
                   routing=args.routing, groups=args.groups, group_topk=args.group_topk,
                   aux_loss_coeff=config.moe.aux_loss_coeff,
                   z_loss_coeff=config.moe.z_loss_coeff, expert_bias_rate=args.bias_rate if args.routing == "sigmoid"
                   else None, dtype=dtype.name, fp8=args.fp8, parameters=total_params,
                   active_parameters=active_params),
        training=dict(steps=args.steps, batch=args.batch, micro_batches=args.micro_batches,
                      tokens_per_step=tokens_per_step, lr=args.lr,
                      seed=args.seed, first_step_seconds=step_seconds[0], seconds=steady_seconds,
                      tokens_per_second=tokens_per_step * (args.steps - 1) / steady_seconds if args.steps > 1
                      else None),
        loss=dict(train=losses, moe=moe_losses, validation=validation_losses,
                  final_train=float(np.mean(losses[tail])), final_validation=validation_losses[-1][1],
                  unigram_baseline=baseline, below_baseline=validation_losses[-1][1] < baseline),
        load_balance=dict(
            expert_share_final=(tokens_per_expert[tail].sum(0) / tokens_per_expert[tail].sum((0, 2))[:, None]).tolist(),
            imbalance_final=imbalance(tokens_per_expert[tail].sum(0)).tolist(),
            imbalance=imbalance(tokens_per_expert).tolist()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_plots(args.out, summary, tokens_per_expert)
    final = summary["loss"]
    progress.log(f"validation loss {final['validation'][0][1]:.3f} -> {final['final_validation']:.3f} nats/byte "
                 f"({'below' if final['below_baseline'] else 'NOT below'} the unigram baseline {baseline:.3f}); "
                 f"{summary['training']['tokens_per_second'] or 0:.0f} tokens/s after the first step "
                 f"({step_seconds[0]:.1f} s, compiling)")
    progress.log(f"wrote {args.out / 'loss.png'}, {args.out / 'expert_share.png'}, {args.out / 'summary.json'}")
    return summary


def running_mean(values: np.ndarray, window: int) -> np.ndarray:
    """The mean of each value and up to ``window - 1`` before it (along the first axis)."""
    sums = np.cumsum(np.concatenate([np.zeros_like(values[:1]), values]), axis=0)
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts).reshape(-1, *[1] * (values.ndim - 1))


def write_plots(out: pathlib.Path, summary: dict, tokens_per_expert: np.ndarray) -> None:
    """``loss.png`` and ``expert_share.png`` from the summary and the per-step ``[steps, L, E]`` counts."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    loss, model = summary["loss"], summary["model"]
    title = (f"{model['layers']} blocks, H={model['hidden']}, {model['experts']} experts top-{model['topk']} "
             f"({model['routing']}), {summary['devices']} x {summary['device']}")
    window = max(1, len(loss["train"]) // 30)

    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=120)
    steps = np.arange(1, len(loss["train"]) + 1)
    axes.plot(steps, loss["train"], color="tab:blue", alpha=0.25, linewidth=0.8)
    axes.plot(steps, running_mean(np.asarray(loss["train"]), window), color="tab:blue",
              label=f"training (mean of {window} steps)")
    validation = np.asarray(loss["validation"])
    # Points only: the validation loss is measured at these steps, not between them.
    axes.plot(validation[:, 0], validation[:, 1], "o", color="tab:orange",
              label=f"validation ({len(validation)} evaluations)")
    axes.axhline(loss["unigram_baseline"], color="gray", linestyle="--",
                 label=f"unigram baseline {loss['unigram_baseline']:.2f}")
    axes.set(xlabel="step", ylabel="next-byte loss (nats)", title=title,
             ylim=(0, max(6.0, float(validation[0, 1]) + 0.2)))
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out / "loss.png")
    plt.close(figure)

    layers, experts = tokens_per_expert.shape[1:]
    share = tokens_per_expert / np.maximum(tokens_per_expert.sum(-1, keepdims=True), 1)
    figure, grid = plt.subplots(layers, 2, figsize=(11, 2.6 * layers + 0.6), dpi=120, squeeze=False,
                                gridspec_kw=dict(width_ratios=(3, 1)))
    # Up to 20 experts: one distinct colour each, named in a legend; more: a colour scale with a colour bar.
    many = experts > 20
    colors = (plt.get_cmap("viridis")(np.linspace(0, 1, experts)) if many
              else plt.get_cmap("tab20" if experts > 10 else "tab10")(np.arange(experts)))
    final = np.asarray(summary["load_balance"]["expert_share_final"])
    for layer, (over_time, at_end) in enumerate(grid):
        over_time.stackplot(np.arange(1, len(share) + 1), running_mean(share[:, layer], window).T, colors=colors)
        over_time.set(xlim=(1, len(share)), ylim=(0, 1), ylabel=f"block {layer}\nshare of tokens")
        at_end.bar(np.arange(experts), final[layer], color=colors)
        at_end.axhline(1 / experts, color="gray", linestyle="--")
        at_end.set(ylim=(0, max(2 / experts, final[layer].max() * 1.1)),
                   title=f"last 10%: max/mean {summary['load_balance']['imbalance_final'][layer]:.2f}",
                   xticks=np.arange(experts) if experts <= 16 else [])
    grid[-1, 0].set_xlabel("step (each colour an expert, stacked)")
    grid[-1, 1].set_xlabel("expert (dashed: uniform)")
    figure.suptitle(f"Tokens routed to each expert: {title}")
    # The legend (or colour bar) goes below the plots, in the room tight_layout leaves for it.
    rows = 3 if many else math.ceil(experts / 10)
    figure.tight_layout(rect=(0, 0.3 * rows / figure.get_figheight(), 1, 1))
    if many:
        scale = matplotlib.cm.ScalarMappable(matplotlib.colors.Normalize(0, experts - 1), plt.get_cmap("viridis"))
        bar = figure.add_axes((0.3, 0.5 / figure.get_figheight(), 0.4, 0.12 / figure.get_figheight()))
        figure.colorbar(scale, cax=bar, orientation="horizontal", label="expert")
    else:
        from matplotlib.patches import Patch
        figure.legend(handles=[Patch(color=colors[e], label=f"expert {e}") for e in range(experts)],
                      loc="lower center", ncol=min(experts, 10), fontsize="small", frameon=False)
    figure.savefig(out / "expert_share.png")
    plt.close(figure)


def main(argv=None) -> int:
    """``python -m oxmoe.train``: exit status 0 when the validation loss ended below the baseline."""
    args = parse_args(argv)
    try:  # the progress bar and the plots: fail now, not after the training
        import matplotlib  # noqa: F401
        import rich  # noqa: F401
    except ModuleNotFoundError as missing:
        sys.exit(f"python -m oxmoe.train needs {missing.name}: {TOOLS_HINT}")
    # Only the CPU backend reads this (before any backend starts): virtual devices to split the experts over.
    jax.config.update("jax_num_cpu_devices", args.devices or 2)
    summary = train(args)
    return 0 if summary["loss"]["below_baseline"] else 1


if __name__ == "__main__":
    sys.exit(main())
