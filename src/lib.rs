//! oxmoe: Mixture-of-Experts primitives for JAX, exported as XLA FFI handlers.
//!
//! Layers, each only calling down: [`ffi`] (a safe view of XLA's call frame),
//! [`cuda`] (NVRTC compilation, module cache, launches), and the primitive
//! families ([`router`], [`permutation`], [`grouped_gemm`], [`activation`], [`quantize`]): CPU implementations as the executable
//! specification, CUDA ones checked against them, and the `extern "C"`
//! handlers registered by the Python package `oxmoe`.

pub mod activation;
pub mod cuda;
pub mod ffi;
pub mod grouped_gemm;
pub mod real;
pub mod permutation;
pub mod quantize;
pub mod router;

use std::ffi::c_char;

/// The library's version and the commit it was built from, e.g. `0.1.0+1a2b3c4`
/// (`0.1.0+1a2b3c4-dirty` when its sources differed from that commit's), so the
/// Python package can tell a stale library from the one it expects.
#[no_mangle]
pub extern "C" fn oxmoe_build_id() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "+", env!("OXMOE_GIT_COMMIT"), "\0").as_ptr().cast()
}

/// Whether this process's handlers poison their results before computing them
/// (`OXMOE_POISON_RESULTS=1`), so a test can check it is testing what it means to.
#[no_mangle]
pub extern "C" fn oxmoe_poisons_results() -> bool {
    ffi::poisons_results()
}
