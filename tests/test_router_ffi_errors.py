"""The FFI handlers check their buffers and attributes themselves: called directly with a
wrong one (bypassing the Python checks), each returns an error that names the target and
the offending value, surfacing as a JaxRuntimeError, and the process lives on.

These are the CPU handlers (on every machine); test_router_gpu.py runs the same cases
against the CUDA handlers."""

import pytest

import ffi_direct_calls


@pytest.fixture(scope="module")
def direct_calls():
    """Runs every direct call once in a child process on CPU: (results by case, cases started, process end)."""
    return ffi_direct_calls.run("cpu")


@pytest.mark.parametrize("case", ffi_direct_calls.CASES)
def test_handler_given_a_wrong_buffer_returns_an_error_naming_it(case, direct_calls):
    ffi_direct_calls.check_case(case, *direct_calls)


def test_process_computes_correctly_after_the_handler_errors(direct_calls):
    results, _, process = direct_calls
    ffi_direct_calls.check_valid_call(results, process, "cpu")
