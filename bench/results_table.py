"""Prints the Markdown tables, one per family, of a benchmark JSON (`python -m oxmoe.bench --json`):
bytes against the copy ceiling for router and permutation, TFLOP/s against a dense GEMM for
grouped_gemm.

    python3 bench/results_table.py bench/h200.json
"""

import json
import sys


def table(results: dict, family: str) -> str:
    goals = results["families"][family]["goals"]
    lines = [
        f"| case | oxmoe µs (median) | min–max | MB | GB/s | % copy | x floor (goal ≤ {goals['max_x_floor']:.2f}) "
        f"| plain JAX µs | speedup (goal ≥ {goals['min_speedup']:g}) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in results["cases"]:
        if case["family"] != family:
            continue
        ours, plain = case["oxmoe"], case["plain_jax"]
        if ours is None:
            lines.append(f"| {case['name']} | FAILED | | | | | | | |")
            continue
        met = "✅" if case["x_floor"] <= goals["max_x_floor"] else "❌"
        lines.append(
            f"| {case['name']} | {ours['median_us']:.1f} | {ours['min_us']:.1f}–{ours['max_us']:.1f} "
            f"| {case['bytes'] / 1e6:.1f} | {case['gb_per_s']:.0f} | {100 * case['fraction_of_copy']:.0f}% "
            f"| {case['x_floor']:.2f}× {met} | {plain['median_us']:.1f} | {case['speedup']:.1f}× |")
    return "\n".join(lines)


def gemm_table(results: dict, family: str) -> str:
    """The table of a family timed in TFLOP/s against a dense GEMM (grouped_gemm)."""
    goal = results["families"][family]["goals"]["min_fraction_of_dense"]
    lines = [
        f"| case | oxmoe µs (median) | min–max | TFLOP/s | dense TFLOP/s | % of dense (goal ≥ {100 * goal:g}%) "
        "| jax.lax.ragged_dot TFLOP/s | × ragged_dot |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in results["cases"]:
        if case["family"] != family:
            continue
        ours = case["oxmoe"]
        if ours is None or case["dense"] is None:
            lines.append(f"| {case['name']} | FAILED | | | | | | |")
            continue
        met = "✅" if case["ratio_to_dense"] >= goal else "❌"
        jax_tflops = case["ragged_dot_tflops"]
        jax_cell = f"{jax_tflops:.0f}" if isinstance(jax_tflops, (int, float)) else jax_tflops or "error"
        speedup = case["ratio_to_ragged_dot"]
        lines.append(
            f"| {case['name']} | {ours['median_us']:.1f} | {ours['min_us']:.1f}–{ours['max_us']:.1f} "
            f"| {case['tflops']:.0f} | {case['dense_tflops']:.0f} | {100 * case['ratio_to_dense']:.0f}% {met} "
            f"| {jax_cell} | {f'{speedup:.1f}×' if speedup is not None else '–'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    results = json.load(open(sys.argv[1]))
    print("\n\n".join(
        f"### {family}\n\n"
        + (gemm_table if "min_fraction_of_dense" in entry["goals"] else table)(results, family)
        for family, entry in results["families"].items()))
