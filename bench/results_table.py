"""Prints the Markdown tables, one per family, of a benchmark's results.json (`python -m oxmoe.bench`):
bytes against the copy ceiling for router and permutation, TFLOP/s against a dense GEMM for
grouped_gemm and the MoE layer (with the expert-parallel cases' breakdown).

    python3 bench/results_table.py bench/h200.json
"""

import json
import sys


def _cases(results: dict, family: str) -> list[dict]:
    return [case for case in results["cases"] if case["family"] == family]


def table(results: dict, family: str) -> str:
    goals = results["families"][family]["goals"]
    lines = [
        f"| case | oxmoe µs (median) | min–max | MB | GB/s | % copy | x floor (goal ≤ {goals['max_x_floor']:.2f}) "
        f"| plain JAX µs | speedup (goal ≥ {goals['min_speedup']:g}) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in _cases(results, family):
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
    for case in _cases(results, family):
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


def layer_table(results: dict, family: str) -> str:
    """The MoE layer's steps against the dense GEMMs of the same FLOPs and the plain-JAX layer,
    then where the time of each expert-parallel step goes."""
    goals = results["families"][family]["goals"]
    lines = [
        f"| case | oxmoe step ms | expert GEMM TFLOP/s | dense TFLOP/s | % of dense (goal ≥ "
        f"{100 * goals['min_fraction_of_dense']:g}%) | plain JAX step ms | × plain JAX (≥ {goals['min_speedup']:g}) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    breakdowns = []
    for case in _cases(results, family):
        if case["skipped"] or case["failure"]:
            lines.append(f"| {case['name']} | {'skipped: ' + case['skipped'] if case['skipped'] else 'FAILED'} "
                         "| | | | | |")
            continue
        met = "✅" if case["ratio_to_dense"] >= goals["min_fraction_of_dense"] else "❌"
        plain = case["plain_jax"]
        plain_cell = f"{plain['median_us'] / 1e3:.2f}" if isinstance(plain, dict) else plain or "–"
        speedup = f"{case['speedup']:.1f}×" if case["speedup"] is not None else "–"
        goal_cell = f"{100 * case['ratio_to_dense']:.0f}% {met}" if case["devices"] == 1 else \
            f"{100 * case['ratio_to_dense']:.0f}% (no goal: {case['devices']} devices)"
        lines.append(f"| {case['name']} | {case['oxmoe']['median_us'] / 1e3:.2f} | {case['tflops']:.0f} "
                     f"| {case['dense_tflops']:.0f} | {goal_cell} | {plain_cell} | {speedup} |")
        if case["breakdown"]:
            step_us = case["oxmoe"]["median_us"]
            rows = [f"| {p['part']} | {p['median_us'] / 1e3:.2f} | {p['per_step'] or '–'} "
                    f"| {100 * p['median_us'] * (p['per_step'] or 1) / step_us:.0f}% |" for p in case["breakdown"]]
            breakdowns.append(f"\n\n{case['name']}: where a step's time goes (per device)\n\n"
                              "| part | ms | times per step | share of the EP step |\n| --- | --- | --- | --- |\n"
                              + "\n".join(rows))
    return "\n".join(lines) + "".join(breakdowns)


if __name__ == "__main__":
    results = json.load(open(sys.argv[1]))
    tables = []
    for family, entry in results["families"].items():
        if family == "moe_layer":
            tables.append(f"### {family}\n\n" + layer_table(results, family))
        else:
            kind = gemm_table if "min_fraction_of_dense" in entry["goals"] else table
            tables.append(f"### {family}\n\n" + kind(results, family))
    print("\n\n".join(tables))
