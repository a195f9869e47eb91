//! The conversions every launch makes.

use crate::ffi::{Error, Result};

/// A size or index as the kernels take it, an `int`. The handlers bound what
/// they decode; a value past 2^31 - 1 is an error, never a wrapped index.
pub fn int(value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| Error::invalid_argument(format!("{value}: the CUDA kernels take sizes as int32, at most {}", i32::MAX)))
}

/// A grid of `blocks` blocks (CUDA takes at most 2^31 - 1 in x).
pub fn grid(blocks: usize) -> Result<u32> {
    u32::try_from(blocks)
        .ok()
        .filter(|&b| b < 1 << 31)
        .ok_or_else(|| Error::invalid_argument(format!("{blocks} blocks: too large a launch")))
}
