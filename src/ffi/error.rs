use std::fmt;
use xla_ffi_sys as sys;

/// The one error type of oxmoe's handlers. It becomes an `XLA_FFI_Error`
/// (prefixed with the handler's name) when it crosses the FFI boundary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    code: sys::XLA_FFI_Error_Code,
    message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The caller passed something the handler cannot accept.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self { code: sys::XLA_FFI_Error_Code_INVALID_ARGUMENT, message: message.into() }
    }

    /// Something inside oxmoe went wrong (a bug, or a failed runtime call).
    pub fn internal(message: impl Into<String>) -> Self {
        Self { code: sys::XLA_FFI_Error_Code_INTERNAL, message: message.into() }
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub(crate) fn code(&self) -> sys::XLA_FFI_Error_Code {
        self.code
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// Returns early with an invalid-argument error built like `format!`.
#[macro_export]
macro_rules! invalid {
    ($($arg:tt)*) => {
        return Err($crate::ffi::Error::invalid_argument(format!($($arg)*)))
    };
}
