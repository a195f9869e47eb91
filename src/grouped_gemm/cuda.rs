//! CUDA implementations of the grouped products (in progress).

use super::handlers::{RaggedDot, TransposedRaggedDot};
use crate::ffi::{Call, Result};
use crate::invalid;

pub fn ragged_dot(_call: &Call, _a: &RaggedDot) -> Result<()> {
    invalid!("not yet")
}

pub fn transposed_ragged_dot(_call: &Call, _a: &TransposedRaggedDot) -> Result<()> {
    invalid!("not yet")
}
