"""bench/fp8_quantize.py (issue 18's quantization benchmark), its smoke run on the default
device: every case (dispatched rows per row and per 128 tokens, transposed for the weight
gradient, weights as they are and transposed, weights and gradient rows both ways, FP8 rows
requantized) timed for oxmoe's primitive and for XLA's fusions of the plain-JAX semantics (both
ways and requantized, also as the calls they replace), and bit for bit the plain-JAX
reference's result.
"""

import json
import pathlib
import runpy

import pytest

BENCH = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[1] / "bench" / "fp8_quantize.py"))


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fp8_quantize") / "fp8_quantize.json"
    BENCH["main"](["--smoke", "--out", str(out)])
    return json.loads(out.read_text())


def test_smoke_run_times_every_case_and_matches_the_reference(report):
    assert report["smoke"] is True and report["goal_fraction_of_copy"] == 0.75
    cases = BENCH["CASES"]
    assert [r["name"] for r in report["rows"]] == [name for name, *_ in cases]
    assert {r["orientation"] for r in report["rows"]} == {"as_is", "transposed", "both"}
    assert any(r["fp8_input"] for r in report["rows"])
    for row, case in zip(report["rows"], cases):
        assert row["shape"] == list(BENCH["smoke_shape"](case.shape)) and row["shape"][-2] == BENCH["SMOKE_ROWS"]
        assert row["block"] == list(case.block) and row["orientation"] == case.orientation
        assert row["fp8_input"] == case.fp8_input
        assert row["bytes"] == BENCH["moved_bytes"](tuple(row["shape"]), case.block, case.orientation, case.fp8_input)
        assert row["matches_reference"], row["name"]
        replaces = case.orientation == "both" or case.fp8_input
        assert ("replaced" in row) == replaces, row["name"]
        for key in ("oxmoe", "xla", "replaced") if replaces else ("oxmoe", "xla"):
            assert row[key]["median_us"] > 0
            assert row[key]["gb_per_s"] == pytest.approx(row["bytes"] / row[key]["median_us"] / 1e3)
