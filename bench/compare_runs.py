"""Compares training runs of ``python -m oxmoe.train``: their validation losses in one plot,
and each run's final validation loss against the first run's (issue 18's FP8 accuracy goal:
the FP8 run within 1% of the bf16 run at the end).

    python3 bench/compare_runs.py RUN_DIR RUN_DIR [...] [--out compare.png]

Each RUN_DIR holds the ``summary.json`` the job wrote (its ``--out``). The first run is the
baseline; each run is labelled by its command's flags that differ from the baseline's.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np


def load(run: pathlib.Path) -> dict:
    path = run / "summary.json" if run.is_dir() else run
    return json.loads(path.read_text())


def label(summary: dict, baseline: dict) -> str:
    """The flags of the run's command that the baseline's lacks (``--fp8``, ...), or its dtype."""
    own, base = summary["command"].split(), baseline["command"].split()
    extra = [flag for flag in own if flag.startswith("--") and flag not in base and flag != "--out"]
    return " ".join(extra) or summary["model"]["dtype"]


def compare(summaries: list[dict]) -> list[dict]:
    """Each run's final validation loss and its ratio to the first run's."""
    base = summaries[0]["loss"]["final_validation"]
    return [dict(label=label(s, summaries[0]), final_validation=s["loss"]["final_validation"],
                 ratio=s["loss"]["final_validation"] / base, tokens_per_second=s["training"]["tokens_per_second"])
            for s in summaries]


def plot(summaries: list[dict], rows: list[dict], out: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=120)
    for summary, row, color in zip(summaries, rows, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        validation = np.asarray(summary["loss"]["validation"])
        axes.plot(validation[:, 0], validation[:, 1], "o-", color=color, markersize=4,
                  label=f"{row['label']}: {row['final_validation']:.4f} ({100 * (row['ratio'] - 1):+.2f}%)")
    baseline = summaries[0]["loss"]["unigram_baseline"]
    axes.axhline(baseline, color="gray", linestyle="--", label=f"unigram baseline {baseline:.2f}")
    model = summaries[0]["model"]
    axes.set(xlabel="step", ylabel="validation loss (nats/byte)",
             title=f"{model['layers']} blocks, H={model['hidden']}, {model['experts']} experts top-{model['topk']}, "
                   f"{summaries[0]['device']}")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=pathlib.Path, help="run folders (the first is the baseline)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("compare.png"))
    args = parser.parse_args(argv)
    summaries = [load(run) for run in args.runs]
    rows = compare(summaries)
    for row in rows:
        print(f"{row['label']}: final validation loss {row['final_validation']:.4f}, {row['ratio']:.4f}x the "
              f"first run's, {row['tokens_per_second']:,.0f} tokens/s")
    plot(summaries, rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
