"""Compares training runs of ``python -m oxmoe.train``: their validation losses in one plot,
and each recipe's final validation loss against the first run's (issue 18's FP8 accuracy goal:
the FP8 run within 1% of the bf16 run at the end).

    python3 bench/compare_runs.py RUN_DIR RUN_DIR [...] [--out compare.png]

Each RUN_DIR holds the ``summary.json`` the job wrote (its ``--out``). Runs are labelled by
their command's flags that the first run's lacks (``--fp8``, ...; not ``--seed`` or ``--out``),
and the runs of one label with different ``--seed`` are one recipe: its mean final validation
loss, the spread over its seeds, and, for each seed the first recipe also ran, the ratio of the
two runs of that seed (same weights and batches at the start, so what differs is the recipe).
The plot shows each recipe's mean curve and, over several seeds, its range. The first recipe
is the baseline.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

#: Flags that name a run, not its recipe.
RUN_FLAGS = ("--out", "--seed")


def load(run: pathlib.Path) -> dict:
    path = run / "summary.json" if run.is_dir() else run
    return json.loads(path.read_text())


def label(summary: dict, baseline: dict) -> str:
    """The flags of the run's command that the baseline's lacks (``--fp8``, ...), or its dtype."""
    own, base = summary["command"].split(), baseline["command"].split()
    extra = [flag for flag in own if flag.startswith("--") and flag not in base and flag not in RUN_FLAGS]
    return " ".join(extra) or summary["model"]["dtype"]


def seed(summary: dict) -> int:
    return summary["training"].get("seed", 0)


def recipes(summaries: list[dict]) -> dict[str, list[dict]]:
    """The runs of each label, in the order the labels first come."""
    grouped: dict[str, list[dict]] = {}
    for summary in summaries:
        grouped.setdefault(label(summary, summaries[0]), []).append(summary)
    return grouped


def compare(grouped: dict[str, list[dict]]) -> list[dict]:
    """Each recipe's final validation losses over its seeds, their mean and its ratio to the first
    recipe's mean, and the ratio to the first recipe's run of the same seed, seed by seed."""
    base_runs = next(iter(grouped.values()))
    base = float(np.mean([s["loss"]["final_validation"] for s in base_runs]))
    base_by_seed = {seed(s): s["loss"]["final_validation"] for s in base_runs}
    rows = []
    for name, runs in grouped.items():
        finals = [s["loss"]["final_validation"] for s in runs]
        mean = float(np.mean(finals))
        paired = {seed(s): s["loss"]["final_validation"] / base_by_seed[seed(s)]
                  for s in runs if seed(s) in base_by_seed}
        rows.append(dict(label=name, seeds=[seed(s) for s in runs], finals=finals,
                         final_validation=mean, ratio=mean / base, paired_ratios=paired,
                         tokens_per_second=float(np.mean([s["training"]["tokens_per_second"] for s in runs]))))
    return rows


def plot(grouped: dict[str, list[dict]], rows: list[dict], out: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=120)
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    for (name, runs), row, color in zip(grouped.items(), rows, colors):
        curves = np.asarray([s["loss"]["validation"] for s in runs])  # [seeds, evaluations, (step, loss)]
        steps, losses = curves[0, :, 0], curves[:, :, 1]
        seeds = f", {len(runs)} seeds (range shaded)" if len(runs) > 1 else ""
        axes.plot(steps, losses.mean(0), "o-", color=color, markersize=4,
                  label=f"{name}: {row['final_validation']:.4f} ({100 * (row['ratio'] - 1):+.2f}%){seeds}")
        if len(runs) > 1:
            axes.fill_between(steps, losses.min(0), losses.max(0), color=color, alpha=0.2)
    first = next(iter(grouped.values()))[0]
    baseline = first["loss"]["unigram_baseline"]
    axes.axhline(baseline, color="gray", linestyle="--", label=f"unigram baseline {baseline:.2f}")
    model = first["model"]
    axes.set(xlabel="step", ylabel="validation loss (nats/byte)",
             title=f"{model['layers']} blocks, H={model['hidden']}, {model['experts']} experts top-{model['topk']}, "
                   f"{first['device']}")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)


def describe(row: dict) -> str:
    """One recipe's line: its final validation loss (mean over its seeds), against the first's."""
    text = f"{row['label']}: final validation loss {row['final_validation']:.4f}"
    if len(row["finals"]) > 1:
        text += f" (mean of {len(row['finals'])} seeds, {min(row['finals']):.4f}-{max(row['finals']):.4f})"
    text += f", {row['ratio']:.4f}x the first run's"
    if len(row["finals"]) > 1 and row["paired_ratios"]:
        text += "; seed by seed " + ", ".join(f"{r:.4f}x (seed {s})" for s, r in row["paired_ratios"].items())
    return text + f", {row['tokens_per_second']:,.0f} tokens/s"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=pathlib.Path, help="run folders (the first is the baseline)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("compare.png"))
    args = parser.parse_args(argv)
    grouped = recipes([load(run) for run in args.runs])
    rows = compare(grouped)
    for row in rows:
        print(describe(row))
    plot(grouped, rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
