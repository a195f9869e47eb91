use super::{DataType, Result};
use crate::invalid;
use xla_ffi_sys as sys;

/// A Rust type an FFI attribute decodes into.
pub trait Attr<'a>: Sized {
    /// What the attribute must be, for error messages.
    const EXPECTED: &'static str;

    /// Decodes the attribute `name` of type `kind` stored at `value`.
    ///
    /// # Safety
    /// `value` must point at the attribute struct that `kind` names.
    unsafe fn decode(name: &str, kind: sys::XLA_FFI_AttrType, value: *const std::ffi::c_void) -> Result<Self>;
}

/// The scalar behind an attribute of type `SCALAR`, or an error.
unsafe fn scalar<'a>(name: &str, kind: sys::XLA_FFI_AttrType, value: *const std::ffi::c_void, expected: &str) -> Result<&'a sys::XLA_FFI_Scalar> {
    if kind != sys::XLA_FFI_AttrType_SCALAR {
        invalid!("attribute `{name}` is not a scalar, expected {expected}")
    }
    Ok(&*value.cast::<sys::XLA_FFI_Scalar>())
}

impl Attr<'_> for i64 {
    const EXPECTED: &'static str = "an integer";

    unsafe fn decode(name: &str, kind: sys::XLA_FFI_AttrType, value: *const std::ffi::c_void) -> Result<Self> {
        let scalar = scalar(name, kind, value, Self::EXPECTED)?;
        match DataType(scalar.dtype) {
            DataType::S64 => Ok(*scalar.value.cast::<i64>()),
            DataType::S32 => Ok(i64::from(*scalar.value.cast::<i32>())),
            other => invalid!("attribute `{name}` has type {other}, expected {}", Self::EXPECTED),
        }
    }
}

impl Attr<'_> for f32 {
    const EXPECTED: &'static str = "a float32";

    unsafe fn decode(name: &str, kind: sys::XLA_FFI_AttrType, value: *const std::ffi::c_void) -> Result<Self> {
        let scalar = scalar(name, kind, value, Self::EXPECTED)?;
        match DataType(scalar.dtype) {
            DataType::F32 => Ok(*scalar.value.cast::<f32>()),
            other => invalid!("attribute `{name}` has type {other}, expected {}", Self::EXPECTED),
        }
    }
}

impl Attr<'_> for bool {
    const EXPECTED: &'static str = "a bool";

    unsafe fn decode(name: &str, kind: sys::XLA_FFI_AttrType, value: *const std::ffi::c_void) -> Result<Self> {
        let scalar = scalar(name, kind, value, Self::EXPECTED)?;
        match DataType(scalar.dtype) {
            DataType::PRED => Ok(*scalar.value.cast::<u8>() != 0),
            other => invalid!("attribute `{name}` has type {other}, expected {}", Self::EXPECTED),
        }
    }
}

impl<'a> Attr<'a> for &'a str {
    const EXPECTED: &'static str = "a string";

    unsafe fn decode(name: &str, kind: sys::XLA_FFI_AttrType, value: *const std::ffi::c_void) -> Result<Self> {
        if kind != sys::XLA_FFI_AttrType_STRING {
            invalid!("attribute `{name}` is not a string")
        }
        let span = &*value.cast::<sys::XLA_FFI_ByteSpan>();
        let bytes = if span.len == 0 { &[][..] } else { std::slice::from_raw_parts(span.ptr.cast::<u8>(), span.len) };
        match std::str::from_utf8(bytes) {
            Ok(text) => Ok(text),
            Err(_) => invalid!("attribute `{name}` is not valid UTF-8"),
        }
    }
}
