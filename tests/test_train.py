"""The training job (python -m oxmoe.train): its data, its model against a plain-JAX
forward written here, its expert-bias step, its command line, and one short run end to end
whose summary and plots are checked against the shipped text and the run's own numbers."""

from __future__ import annotations

import collections
import json
import math
import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("matplotlib")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import moe_reference  # noqa: E402
from oxmoe import fp8, train  # noqa: E402
from oxmoe.moe import MoEConfig  # noqa: E402

HIGHEST = jax.lax.Precision.HIGHEST
PLAYS = pathlib.Path(train.__file__).parent / "data" / "shakespeare"


def test_corpus_is_every_play_split_ninety_ten():
    corpus = train.load_corpus()
    plays = sorted(PLAYS.glob("*.txt"))
    assert len(plays) == 8 and corpus.sources == tuple(p.name for p in plays)
    texts = [p.read_bytes() for p in plays]
    cuts = [int(len(t) * 0.9) for t in texts]
    assert corpus.train.tobytes() == b"".join(t[:c] for t, c in zip(texts, cuts))
    assert corpus.validation.tobytes() == b"".join(t[c:] for t, c in zip(texts, cuts))


def test_unigram_baseline_is_the_entropy_of_the_byte_frequencies():
    validation = train.load_corpus().validation
    counts = collections.Counter(validation.tobytes())
    n = len(validation)
    expected = -sum(c / n * math.log(c / n) for c in counts.values())
    assert train.unigram_entropy(validation) == pytest.approx(expected, rel=1e-12)
    assert 3.0 < expected < 3.6  # English letters, spaces and newlines: about 4.7 bits


def test_windows_are_consecutive_bytes(rng):
    data = (np.arange(10_000) % 251).astype(np.uint8)
    windows = train.sample_windows(data, rng, batch=64, length=33)
    assert windows.shape == (64, 34) and windows.dtype == np.int32
    np.testing.assert_array_equal(np.diff(windows, axis=1) % 251, 1)


def test_running_mean_and_imbalance(rng):
    values = rng.normal(size=(50, 3))
    expected = np.stack([values[max(0, i - 6):i + 1].mean(0) for i in range(50)])
    # Differences of running sums: float64's rounding of sums up to ~10 in absolute terms, which a
    # mean near zero cannot meet relatively (1.2e-12 seen at -3e-4).
    np.testing.assert_allclose(train.running_mean(values, 7), expected, rtol=1e-12, atol=1e-13)
    counts = rng.integers(0, 100, size=(4, 8))
    np.testing.assert_allclose(train.imbalance(counts), counts.max(1) / counts.mean(1), rtol=1e-12)


def _mesh(size):
    return jax.make_mesh((size,), (train.EXPERT_AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices("cpu")[:size])


def _model(rng, moe_config, *, devices=2, layers=2, hidden=64, heads=4, ffn=32, seq_len=32):
    config = train.ModelConfig(layers=layers, hidden=hidden, heads=heads, ffn=ffn, seq_len=seq_len, moe=moe_config)
    model, optimizer = train.create_model(config, _mesh(devices), int(rng.integers(1 << 30)), optax.sgd(0.1))
    return config, model, optimizer


def _rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _reference_logits(model, config, tokens):
    """The model's forward written out: byte and position embeddings, per block RMS-normed
    causal attention and the dense MoE reference, a final norm, the embedding transposed."""
    heads, (b, s) = config.heads, tokens.shape
    embedding = model.embed.embedding[...]
    x = embedding[tokens] + model.positions.embedding[...][:s]
    for block in model.blocks:
        h = _rms_norm(x, block.attention_norm.scale[...])
        qkv = jnp.dot(h, block.attention.qkv.kernel[...], precision=HIGHEST).reshape(b, s, 3, heads, -1)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) / math.sqrt(q.shape[-1])
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
        attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v, precision=HIGHEST)
        x = x + jnp.dot(attended.reshape(b, s, -1), block.attention.out.kernel[...], precision=HIGHEST)
        moe = block.moe
        def value(variable):
            return None if variable is None else variable[...]

        params = moe_reference.Params(gate=moe.gate[...], up=moe.up[...], down=moe.down[...],
                                      expert_bias=value(moe.expert_bias), shared_up=value(moe.shared_up),
                                      shared_down=value(moe.shared_down))
        y, _ = moe_reference.moe(_rms_norm(x, block.moe_norm.scale[...]), params, config.moe)
        x = x + y
    return jnp.dot(_rms_norm(x, model.final_norm.scale[...]), embedding.T, precision=HIGHEST)


@pytest.mark.parametrize("routing", ["softmax", "sigmoid", "softmax_shared_experts"])
def test_model_matches_a_plain_jax_forward(rng, routing):
    shared = routing == "softmax_shared_experts"
    routing = "softmax" if shared else routing
    moe_config = MoEConfig(num_experts=8, topk=2, score_function=routing, use_expert_bias=routing == "sigmoid",
                           num_groups=4 if routing == "sigmoid" else None, group_topk=2 if routing == "sigmoid" else None,
                           dtype=jnp.float32, shared_ffn=64 if shared else None)
    config, model, _ = _model(rng, moe_config)
    if routing == "sigmoid":  # a bias that changes the choice of experts
        for block in model.blocks:
            block.moe.expert_bias[...] = jnp.asarray(rng.normal(0, 0.5, 8), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 256, (4, 32)), jnp.int32)
    # Both jitted: op by op, the two forwards took minutes on a CI core.
    logits, auxes = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)
    expected = nnx.jit(lambda model, tokens: _reference_logits(model, config, tokens))(model, tokens)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), rtol=2e-4, atol=2e-4)
    assert len(auxes) == 2 and all(int(a.tokens_per_expert.sum()) == 4 * 32 * 2 for a in auxes)


def test_train_step_moves_the_expert_bias_by_the_returned_counts(rng):
    moe_config = MoEConfig(num_experts=8, topk=2, score_function="sigmoid", use_expert_bias=True, dtype=jnp.float32)
    _, model, optimizer = _model(rng, moe_config, devices=4)
    windows = jnp.asarray(rng.integers(0, 256, (8, 33)), jnp.int32)
    before = [np.asarray(block.moe.expert_bias[...]) for block in model.blocks]
    byte_loss, moe_loss, counts = train.train_step(model, optimizer, windows, jnp.float32(0.01))
    counts = np.asarray(counts)
    assert counts.shape == (2, 8) and (counts.sum(1) == 8 * 32 * 2).all()
    for block, old, layer_counts in zip(model.blocks, before, counts):
        expected = old + 0.01 * np.sign(layer_counts.mean() - layer_counts)
        np.testing.assert_allclose(np.asarray(block.moe.expert_bias[...]), expected, rtol=1e-6)
    assert float(moe_loss) == 0.0  # sigmoid routing defaults to no aux loss, and z-loss is off here
    assert 5.0 < float(byte_loss) < 6.5  # untrained: about log(256) = 5.55


@pytest.mark.parametrize("recipe", [None, fp8.BlockScaling()], ids=["float32", "fp8"])
def test_micro_batches_step_on_the_mean_of_their_gradients(rng, recipe):
    """Gradient accumulation: the step with --micro-batches 2 against the two micro-batches'
    gradients taken apart (windows 0, 2, 4, ... and 1, 3, 5, ...), the model quantizing its own
    FP8 weights in each, averaged and applied by SGD; a load-balancing loss, which depends on
    how the batch is split, is on. Float32 element by element, to float32's rounding; FP8 each
    weight's move as a whole, to 3% of its norm (0.1-0.7% seen): the reference is compiled apart, and a
    float32 sum rounded otherwise before a quantization may round to a neighbouring FP8 value
    (1/8 apart), which moves a few elements (the column of one token's value) by more. The split
    itself is checked on the losses."""
    moe_config = MoEConfig(num_experts=8, topk=2, aux_loss_coeff=1.0, dtype=jnp.float32, fp8=recipe)
    seed = int(rng.integers(1 << 30))
    sizes = dict(hidden=128, ffn=128) if recipe else {}
    _, model, optimizer = _model(np.random.default_rng(seed), moe_config, devices=4, **sizes)
    _, reference, _ = _model(np.random.default_rng(seed), moe_config, devices=4, **sizes)
    windows = jnp.asarray(rng.integers(0, 256, (8, 33)), jnp.int32)
    before = jax.tree.map(lambda p: np.asarray(p, np.float64), nnx.state(model, nnx.Param))

    byte_loss, moe_loss, counts = train.train_step(model, optimizer, windows, jnp.float32(0.0), micro_batches=2)

    def loss(model, batch):
        logits, auxes = model(batch[:, :-1])
        byte_loss = train.next_byte_loss(logits, batch[:, 1:])
        moe_loss = sum(aux.load_balancing_loss + aux.z_loss for aux in auxes)
        return byte_loss + moe_loss, (byte_loss, moe_loss, jnp.stack([aux.tokens_per_expert for aux in auxes]))

    gradients = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    (_, (byte_a, moe_a, counts_a)), grads_a = gradients(reference, windows[0::2])
    (_, (byte_b, moe_b, counts_b)), grads_b = gradients(reference, windows[1::2])
    assert float(moe_a) != pytest.approx(float(moe_b), rel=1e-4)  # the split matters to the MoE loss
    # FP8: the losses move when an activation rounds to a neighbouring FP8 value (3e-5 seen on CI).
    loss_rtol = 1e-3 if recipe else 1e-5
    np.testing.assert_allclose(float(byte_loss), (float(byte_a) + float(byte_b)) / 2, rtol=loss_rtol)
    np.testing.assert_allclose(float(moe_loss), (float(moe_a) + float(moe_b)) / 2, rtol=loss_rtol)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(counts_a) + np.asarray(counts_b))
    # SGD at 0.1: each parameter moved by -0.1 times the mean of the two gradients.
    moves = jax.tree.map(lambda a, b: -0.1 * (np.asarray(a, np.float64) + np.asarray(b, np.float64)) / 2,
                         grads_a, grads_b)
    after = nnx.state(model, nnx.Param)
    for (path, got), old, move in zip(jax.tree.leaves_with_path(after), jax.tree.leaves(before),
                                      jax.tree.leaves(moves)):
        got = np.asarray(got, np.float64)
        if recipe:
            error = np.linalg.norm(got - old - move) / np.linalg.norm(move)
            assert error < 3e-2, f"{jax.tree_util.keystr(path)}: moved {error:.2%} of its norm away"
        else:
            np.testing.assert_allclose(got, old + move, rtol=2e-7, atol=1e-4 * np.abs(move).max(),
                                       err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("argv, message", [
    (["--heads", "3"], "--heads 3 must divide --hidden 128"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--fp8", "--ffn", "96"], "--fp8 needs --hidden and --ffn multiples of 128 (one scale per 128), got 128 and 96"),
    (["--fp8-square-gradients"], "--fp8-square-gradients is an option of --fp8's recipe: give --fp8 too"),
    (["--micro-batches", "0"], "--micro-batches must be at least 1, got 0"),
])
def test_bad_flags_are_named(capsys, argv, message):
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert message in capsys.readouterr().err


def test_devices_must_divide_experts_and_batch():
    with pytest.raises(SystemExit, match="--experts 6 is not a multiple of the 4 devices"):
        train.make_mesh(4, 6, 8)
    with pytest.raises(SystemExit, match="--batch 6 is not a multiple of the 4 devices"):
        train.make_mesh(4, 8, 6)
    with pytest.raises(SystemExit, match="--batch 12 is not a multiple of --micro-batches 2 times the 4 devices"):
        train.make_mesh(4, 8, 12, 2)


def test_more_devices_than_the_machine_has_are_named():
    # Derived from the machine the test runs on (CPU virtual devices, one GPU, eight GPUs, ...).
    available = jax.devices()
    wanted = 2 * len(available)
    with pytest.raises(SystemExit, match=rf"--devices {wanted}: only {len(available)} "
                                         rf"{available[0].platform} device\(s\) here"):
        train.make_mesh(wanted, 4 * wanted, 4 * wanted)


@pytest.mark.parametrize("module", ["optax", "matplotlib"])
def test_without_the_tools_extra_the_job_says_what_to_install(module):
    code = (f"import sys, runpy; sys.modules[{module!r}] = None; sys.argv = ['train']; "
            "runpy.run_module('oxmoe.train', run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert run.stderr.strip().endswith(f"python -m oxmoe.train needs {module}: pip install 'oxmoe[tools]' "
                                       "(flax, optax, rich and matplotlib)"), run.stderr
    assert "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("experts", [8, 32])
def test_the_plots_mark_evaluations_as_points_and_name_the_expert_colours(experts, tmp_path, monkeypatch, rng):
    import matplotlib.figure

    saved = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda figure, path, **_: saved.update({
        pathlib.Path(path).name: figure}))
    steps, layers = 60, 2
    counts = rng.integers(0, 100, size=(steps, layers, experts))
    tail = counts[-6:].sum(0)
    summary = dict(devices=4, device="cpu", model=dict(layers=layers, hidden=64, experts=experts, topk=2,
                                                       routing="softmax"),
                   loss=dict(train=list(np.linspace(5, 2, steps)), validation=[(0, 5.5), (30, 3.0), (60, 2.5)],
                             unigram_baseline=3.3),
                   load_balance=dict(expert_share_final=(tail / tail.sum(1, keepdims=True)).tolist(),
                                     imbalance_final=[1.2, 1.3]))
    train.write_plots(tmp_path, summary, counts)

    # loss.png: the three evaluations as markers, with no line drawn between them.
    (validation,) = [line for line in saved["loss.png"].axes[0].get_lines()
                     if line.get_label().startswith("validation")]
    assert validation.get_marker() == "o" and validation.get_linestyle() == "None"
    np.testing.assert_array_equal(validation.get_xdata(), [0, 30, 60])
    # expert_share.png: which colour is which expert (a legend entry each; a colour bar past 20 experts).
    share = saved["expert_share.png"]
    if experts <= 20:
        (legend,) = share.legends
        assert [t.get_text() for t in legend.get_texts()] == [f"expert {e}" for e in range(experts)]
    else:
        assert any(axes.get_xlabel() == "expert" for axes in share.axes if axes not in share.axes[:2 * layers])


def test_shared_experts_flag_gives_shared_ffn_of_that_many_experts():
    assert train.moe_config(train.parse_args(["--shared-experts", "2", "--ffn", "48"]), jnp.float32).shared_ffn == 96
    assert train.moe_config(train.parse_args([]), jnp.float32).shared_ffn is None


def test_fp8_flag_gives_the_block_scaling_recipe():
    assert train.moe_config(train.parse_args(["--fp8"]), jnp.float32).fp8 == fp8.BlockScaling()
    assert train.moe_config(train.parse_args(["--fp8", "--fp8-square-gradients"]), jnp.float32).fp8 == \
        fp8.BlockScaling(square_gradient_blocks=True)
    assert train.moe_config(train.parse_args([]), jnp.float32).fp8 is None


def test_bad_routing_is_named():
    args = train.parse_args(["--groups", "3", "--group-topk", "1"])
    with pytest.raises(SystemExit, match="bad routing options: .*groups"):
        train.moe_config(args, jnp.float32)


def _png_size(path: pathlib.Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR"
    return struct.unpack(">II", header[16:24])


def test_a_short_run_learns_and_reports_it(tmp_path):
    """Sigmoid routing with groups, experts split over 4 virtual CPU devices, 60 steps."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the job picks its own device count
    env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, "-m", "oxmoe.train", "--steps", "60", "--batch", "16", "--seq-len", "64",
               "--eval-every", "30", "--experts", "8", "--topk", "2", "--routing", "sigmoid", "--groups", "4",
               "--group-topk", "2", "--devices", "4", "--out", str(out)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())

    validation = train.load_corpus().validation
    loss = summary["loss"]
    assert loss["unigram_baseline"] == pytest.approx(train.unigram_entropy(validation), rel=1e-12)
    assert [step for step, _ in loss["validation"]] == [0, 30, 60]
    assert loss["validation"][0][1] == pytest.approx(math.log(256), abs=0.5)  # untrained
    assert loss["final_validation"] < loss["unigram_baseline"] - 0.1, loss["validation"]
    assert len(loss["train"]) == 60 and loss["final_train"] == pytest.approx(np.mean(loss["train"][-6:]))
    assert summary["devices"] == 4 and summary["model"]["routing"] == "sigmoid"
    assert summary["training"]["tokens_per_step"] == 16 * 64 and summary["training"]["tokens_per_second"] > 0

    share = np.asarray(summary["load_balance"]["expert_share_final"])
    assert share.shape == (2, 8)
    np.testing.assert_allclose(share.sum(1), 1, rtol=1e-12)
    np.testing.assert_allclose(summary["load_balance"]["imbalance_final"], share.max(1) * 8, rtol=1e-9)
    assert f"{loss['final_validation']:.3f}" in run.stderr and "below the unigram baseline" in run.stderr
    # Each progress line shows the latest validation loss with the step it was measured at; the last
    # line's is the final one.
    evaluated = dict(loss["validation"])
    lines = [line for line in run.stderr.splitlines() if line.startswith("step ")]
    assert lines and lines[-1].startswith("step 60/60 "), run.stderr[-3000:]
    for line in lines:
        step = int(line.split()[1].split("/")[0])
        val_step = step // 30 * 30
        assert f"val {evaluated[val_step]:.3f} @ step {val_step} " in line, line

    assert _png_size(out / "loss.png") == (960, 540)
    assert _png_size(out / "expert_share.png") == (1320, int((2.6 * 2 + 0.6) * 120))


def test_compare_runs_puts_each_final_validation_loss_against_the_first(tmp_path, capsys):
    """bench/compare_runs.py (issue 18's FP8 accuracy check): two summaries as the job writes
    them, the second with --fp8 and a final validation loss 0.5% above the first's."""
    import runpy

    compare_runs = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[1] / "bench" / "compare_runs.py"))
    base = ["python", "-m", "oxmoe.train", "--layers", "4", "--out", "a"]
    for name, command, final in (("bf16", base, 2.0), ("fp8", base[:-2] + ["--fp8", "--out", "b"], 2.01)):
        run = tmp_path / name
        run.mkdir()
        summary = dict(command=" ".join(command), device="cpu",
                       model=dict(layers=4, hidden=512, experts=32, topk=4, dtype="bfloat16"),
                       loss=dict(validation=[[0, 5.5], [150, 2.5], [300, final]], final_validation=final,
                                 unigram_baseline=3.32),
                       training=dict(tokens_per_second=1000.0))
        (run / "summary.json").write_text(json.dumps(summary))
    summaries = [compare_runs["load"](tmp_path / n) for n in ("bf16", "fp8")]
    rows = compare_runs["compare"](compare_runs["recipes"](summaries))
    assert [r["label"] for r in rows] == ["bfloat16", "--fp8"]
    assert rows[1]["ratio"] == pytest.approx(1.005)
    compare_runs["main"]([str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--out", str(tmp_path / "c.png")])
    assert "--fp8: final validation loss 2.0100, 1.0050x the first run's" in capsys.readouterr().out
    assert _png_size(tmp_path / "c.png") == (960, 540)


def test_compare_runs_takes_the_runs_of_one_recipe_over_seeds_together(tmp_path, capsys):
    """Several seeds of each recipe: a recipe's final loss is the mean over its seeds, against the
    first recipe's mean, and each seed's run against the first recipe's run of that seed."""
    import runpy

    compare_runs = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[1] / "bench" / "compare_runs.py"))
    runs = []
    for recipe, flags, finals in (("bf16", [], (2.0, 2.1)), ("fp8", ["--fp8"], (2.02, 2.079))):
        for seed, final in enumerate(finals):
            run = tmp_path / f"{recipe}_{seed}"
            run.mkdir()
            command = ["python", "-m", "oxmoe.train", "--layers", "4", *flags, "--seed", str(seed), "--out", str(run)]
            summary = dict(command=" ".join(command), device="cpu",
                           model=dict(layers=4, hidden=512, experts=32, topk=4, dtype="bfloat16"),
                           loss=dict(validation=[[0, 5.5], [150, 2.5 + seed / 10], [300, final]],
                                     final_validation=final, unigram_baseline=3.32),
                           training=dict(tokens_per_second=1000.0, seed=seed))
            (run / "summary.json").write_text(json.dumps(summary))
            runs.append(run)
    rows = compare_runs["compare"](compare_runs["recipes"]([compare_runs["load"](run) for run in runs]))
    assert [(r["label"], r["seeds"]) for r in rows] == [("bfloat16", [0, 1]), ("--fp8", [0, 1])]
    assert rows[0]["final_validation"] == pytest.approx(2.05)
    assert rows[1]["final_validation"] == pytest.approx(2.0495)
    assert rows[1]["ratio"] == pytest.approx(2.0495 / 2.05)
    assert rows[1]["paired_ratios"] == pytest.approx({0: 1.01, 1: 2.079 / 2.1})
    compare_runs["main"]([*map(str, runs), "--out", str(tmp_path / "c.png")])
    assert ("--fp8: final validation loss 2.0495 (mean of 2 seeds, 2.0200-2.0790), 0.9998x the first run's; "
            "seed by seed 1.0100x (seed 0), 0.9900x (seed 1)") in capsys.readouterr().out
    assert _png_size(tmp_path / "c.png") == (960, 540)
