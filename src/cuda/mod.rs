//! The CUDA runtime: kernels from `kernels/*.cu`, compiled by NVRTC for the
//! exact architecture of the device in front of us with their static shape
//! parameters and their launch's constants as template arguments (named by
//! [`Instance`]), cached in memory and on disk, and launched on the stream
//! XLA hands a handler. Nothing here synchronises or copies to the host.
//!
//! The driver (`libcuda.so.1`) and NVRTC (`libnvrtc.so.13`) are loaded at
//! first use, so the crate builds and its CPU handlers run without CUDA.
//! The Python package finds NVRTC (pip wheel or toolkit) and loads it
//! globally before any CUDA handler runs.

mod driver;
mod instance;
mod launch;
mod nvrtc;

pub use driver::{arg, launch, Device, Kernel, LaunchConfig, Stream, TensorMap};
pub use instance::Instance;
pub use launch::{grid, int};
pub use nvrtc::{assert_compiles, compile_check, Architecture};

use crate::ffi::{DataType, Error, Result};
use crate::invalid;

/// A CUDA source file of `kernels/`, embedded in the library.
pub struct Source {
    pub name: &'static str,
    pub text: &'static str,
}

/// Headers every kernel source may include, by these names.
const HEADERS: [Source; 2] = [
    Source { name: "common.cuh", text: include_str!("../../kernels/common.cuh") },
    Source { name: "hopper.cuh", text: include_str!("../../kernels/hopper.cuh") },
];

/// The router kernels.
pub const ROUTER: Source = Source { name: "router.cu", text: include_str!("../../kernels/router.cu") };

/// The permutation kernels.
pub const PERMUTATION: Source = Source { name: "permutation.cu", text: include_str!("../../kernels/permutation.cu") };

/// The grouped GEMM kernels.
pub const GROUPED_GEMM: Source = Source { name: "grouped_gemm.cu", text: include_str!("../../kernels/grouped_gemm.cu") };

/// The expert activation's backward.
pub const ACTIVATION: Source = Source { name: "activation.cu", text: include_str!("../../kernels/activation.cu") };

/// The FP8 quantization kernel.
pub const QUANTIZE: Source = Source { name: "quantize.cu", text: include_str!("../../kernels/quantize.cu") };

/// The kernels' name for an element type (see `kernels/common.cuh`).
pub fn type_name(dtype: DataType) -> Result<&'static str> {
    Ok(match dtype {
        DataType::F32 => "float",
        DataType::BF16 => "bf16",
        DataType::F16 => "f16",
        DataType::S32 => "int",
        other => invalid!("no CUDA kernel for dtype {other}"),
    })
}

fn driver_error(call: &str, error: cudarc::driver::DriverError) -> Error {
    let name = error.error_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", error.0));
    Error::internal(format!("{call} failed: {name}"))
}
