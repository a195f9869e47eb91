"""The FFI handlers check their buffers and attributes themselves: called directly with a
wrong one (bypassing the Python checks), each returns an error that names the target and
the offending value, surfacing as a JaxRuntimeError, and the process lives on."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ffi_direct_calls
import router_reference as ref

SCRIPT = Path(__file__).with_name("ffi_direct_calls.py")


@pytest.fixture(scope="module")
def direct_calls():
    """Runs every direct call once in a child process: (results by case, the process's exit and output)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    results, started = {}, []
    for line in proc.stdout.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("started"):
            started.append(record["case"])
        else:
            results[record["case"]] = record
    process = f"exit status {proc.returncode}; stderr tail:\n{proc.stderr[-3000:]}"
    return results, started, process


@pytest.mark.parametrize("case", ffi_direct_calls.CASES)
def test_handler_given_a_wrong_buffer_returns_an_error_naming_it(case, direct_calls):
    results, started, process = direct_calls
    _, target, patterns = ffi_direct_calls.CASES[case]
    if case not in results:
        crashed_in = started[-1] if started else "(before the first case)"
        pytest.fail(f"no result for {case}: the process died during {crashed_in}; {process}")
    result = results[case]
    assert result["raised"] is not None, f"{target} accepted the bad call {case} without an error"
    assert result["jax_runtime_error"], f"{case}: raised {result['raised']}, expected JaxRuntimeError: {result['message']}"
    message = result["message"]
    assert target in message, f"{case}: the message does not name {target}: {message!r}"
    for pattern in patterns:
        assert re.search(pattern, message, re.IGNORECASE), (
            f"{case}: the message does not name the offending value (/{pattern}/): {message!r}"
        )


def test_process_computes_correctly_after_the_handler_errors(direct_calls):
    results, _, process = direct_calls
    assert ffi_direct_calls.VALID_CALL in results, f"the valid call after the errors did not finish; {process}"
    result = results[ffi_direct_calls.VALID_CALL]
    expected = ref.topk(np.asarray(ffi_direct_calls.LOGITS), 2)
    np.testing.assert_array_equal(np.asarray(result["routing_map"]), expected.routing_map)
    np.testing.assert_allclose(np.asarray(result["probs"]), expected.probs, rtol=1e-6, atol=1e-7)
