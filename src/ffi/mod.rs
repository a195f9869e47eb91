//! A safe layer over the XLA FFI call frame.
//!
//! `xla_ffi_sys` is raw; this module turns a call frame into typed buffers,
//! typed attributes and `Result`s, answers XLA's metadata query, refuses calls
//! at stages oxmoe does not implement, and turns every error (and every panic)
//! into an `XLA_FFI_Error` that names the handler. A handler is then an
//! ordinary function `fn(&Call) -> Result<()>`, exported with
//! [`export_handler!`](crate::export_handler).

mod attrs;
mod buffer;
mod call;
mod dtype;
mod error;
#[cfg(test)]
mod tests;

pub use attrs::Attr;
pub use buffer::{Arg, Element, Ret};
pub use call::{run_handler, Call, Scratch, Traits};
pub use dtype::DataType;
pub use error::{Error, Result};

/// Exports `$body` (a `fn(&Call) -> Result<()>` or a closure that captures
/// nothing) as the C symbol `$symbol`, an XLA FFI handler for the execute stage.
#[macro_export]
macro_rules! export_handler {
    ($symbol:ident, $body:expr) => {
        $crate::export_handler!($symbol, $body, $crate::ffi::Traits::NONE);
    };
    ($symbol:ident, $body:expr, $traits:expr) => {
        /// XLA FFI handler; register it with `jax.ffi.register_ffi_target`.
        ///
        /// # Safety
        /// `frame` must be a call frame handed over by the XLA runtime.
        #[no_mangle]
        pub unsafe extern "C" fn $symbol(
            frame: *mut ::xla_ffi_sys::XLA_FFI_CallFrame,
        ) -> *mut ::xla_ffi_sys::XLA_FFI_Error {
            $crate::ffi::run_handler(stringify!($symbol), $traits, frame, $body)
        }
    };
}
