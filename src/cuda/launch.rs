//! What a family's CUDA backend launches with.

use super::Stream;
use crate::ffi::{Call, DeviceMemory, Result, Scratch};

/// What a CUDA backend needs of its handler's call: the stream its work goes
/// on and XLA's allocator for scratch memory. The handler builds it, so the
/// backend never sees the call frame.
pub struct LaunchContext<'a> {
    pub stream: Stream,
    memory: DeviceMemory<'a>,
}

impl<'a> LaunchContext<'a> {
    /// The call's stream (see [`Stream::begin`]) and allocator.
    pub fn begin(call: &Call<'a>) -> Result<Self> {
        Ok(Self { stream: Stream::begin(call)?, memory: call.device_memory()? })
    }

    /// `bytes` of device memory (see [`DeviceMemory::scratch`]).
    pub fn scratch(&self, bytes: usize) -> Result<Scratch<'a>> {
        self.memory.scratch(bytes)
    }
}
