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
pub use buffer::{poison_byte, poisons_results, Arg, Element, Ret};
pub(crate) use buffer::byte_range;
pub use call::{run_handler, Call, Traits};
pub use dtype::DataType;
pub use error::{Error, Result};

/// Exports the C symbol `$symbol`, an XLA FFI handler for the execute stage:
/// it decodes the call into `$decoded` (its `decode(&Call) -> Result<Self>`),
/// checks the call holds nothing else ([`Call::check_complete`]), then runs
/// `$run(&Call, $decoded) -> Result<()>` (a closure that captures nothing),
/// unless no result holds an element (nothing to write, so no kernel to run).
#[macro_export]
macro_rules! export_handler {
    ($symbol:ident, $decoded:ty, $run:expr) => {
        $crate::export_handler!($symbol, $decoded, $run, $crate::ffi::Traits::NONE);
    };
    ($symbol:ident, $decoded:ty, $run:expr, $traits:expr) => {
        /// XLA FFI handler; register it with `jax.ffi.register_ffi_target`.
        ///
        /// # Safety
        /// `frame` must be a call frame handed over by the XLA runtime.
        #[no_mangle]
        pub unsafe extern "C" fn $symbol(
            frame: *mut ::xla_ffi_sys::XLA_FFI_CallFrame,
        ) -> *mut ::xla_ffi_sys::XLA_FFI_Error {
            $crate::ffi::run_handler(stringify!($symbol), $traits, frame, |call| {
                let run: fn(&$crate::ffi::Call, $decoded) -> $crate::ffi::Result<()> = $run;
                let decoded = <$decoded>::decode(call)?;
                call.check_complete()?;
                if call.writes_nothing() {
                    return Ok(());
                }
                run(call, decoded)
            })
        }
    };
}
