//! Floating-point element types the kernels read and write, computed in f32.

use crate::ffi::Element;
use half::{bf16, f16};

/// A float element type whose arithmetic oxmoe does in f32.
pub trait Real: Element {
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
}

impl Real for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl Real for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
}

impl Real for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        f16::from_f32(value)
    }
}

/// The float types activations and router logits may have.
pub const FLOAT_TYPES: [crate::ffi::DataType; 3] =
    [crate::ffi::DataType::F32, crate::ffi::DataType::BF16, crate::ffi::DataType::F16];

/// `(rows, columns)` of a float matrix argument.
pub fn float_matrix(arg: &crate::ffi::Arg) -> crate::ffi::Result<(usize, usize)> {
    arg.expect_dtype(&FLOAT_TYPES)?;
    arg.matrix()
}

/// Runs `$body` with `$t` bound to the Rust type of the float dtype `$dtype`
/// (one of [`FLOAT_TYPES`]).
#[macro_export]
macro_rules! with_real_type {
    ($dtype:expr, $t:ident => $body:expr) => {{
        match $dtype {
            $crate::ffi::DataType::F32 => {
                type $t = f32;
                $body
            }
            $crate::ffi::DataType::BF16 => {
                type $t = half::bf16;
                $body
            }
            $crate::ffi::DataType::F16 => {
                type $t = half::f16;
                $body
            }
            other => $crate::invalid!("unsupported float dtype {other}"),
        }
    }};
}
