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
pub use nvrtc::{assert_compiles, assert_family_compiles, compile_check, Architecture};

use crate::ffi::{DataType, Error, Result};
use crate::invalid;

/// [`export_handler!`](crate::export_handler) for a CUDA handler: `$run`
/// takes the call's [`Stream`] (see [`Stream::begin`]) and the decoded call.
/// The handler reports [`Traits::COMMAND_BUFFER_COMPATIBLE`](crate::ffi::Traits),
/// so XLA may capture its execute stage in a CUDA graph, and it runs at the
/// initialize stage too, where it loads the kernels its execute stage launches
/// and launches nothing (the Python package registers it for both stages).
#[macro_export]
macro_rules! export_cuda_handler {
    ($symbol:ident, $decoded:ty, $run:expr) => {
        $crate::export_handler!(
            $symbol,
            $decoded,
            |call, op| {
                let run: fn($crate::cuda::Stream, $decoded) -> $crate::ffi::Result<()> = $run;
                run($crate::cuda::Stream::begin(call)?, op)
            },
            $crate::ffi::Traits::COMMAND_BUFFER_COMPATIBLE
        );
    };
}

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
