//! What a family's CUDA backend launches with, and the conversions every
//! launch makes.

use super::Stream;
use crate::ffi::{Call, Error, Result};

/// What a CUDA backend needs of its handler's call: the stream its work goes
/// on. The handler builds it, so the backend never sees the call frame; memory
/// of the kernels' own comes as the call's workspace result
/// ([`Call::workspace`]), never allocated during the call, so that XLA may
/// capture the call in a CUDA graph.
pub struct LaunchContext {
    pub stream: Stream,
}

impl LaunchContext {
    /// The call's stream (see [`Stream::begin`]).
    pub fn begin(call: &Call) -> Result<Self> {
        Ok(Self { stream: Stream::begin(call)? })
    }
}

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
