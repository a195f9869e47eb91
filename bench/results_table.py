"""Prints the Markdown tables, one per family, of a benchmark JSON (`python -m oxmoe.bench --json`).

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


if __name__ == "__main__":
    results = json.load(open(sys.argv[1]))
    print("\n\n".join(f"### {family}\n\n{table(results, family)}" for family in results["families"]))
