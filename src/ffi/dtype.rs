use std::fmt;
use xla_ffi_sys as sys;

/// The element type of a buffer or scalar attribute, as XLA names it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DataType(pub(crate) sys::XLA_FFI_DataType);

impl DataType {
    pub const PRED: Self = Self(sys::XLA_FFI_DataType_PRED);
    pub const S32: Self = Self(sys::XLA_FFI_DataType_S32);
    pub const S64: Self = Self(sys::XLA_FFI_DataType_S64);
    pub const F16: Self = Self(sys::XLA_FFI_DataType_F16);
    pub const BF16: Self = Self(sys::XLA_FFI_DataType_BF16);
    pub const F32: Self = Self(sys::XLA_FFI_DataType_F32);

    /// Bits per element, for the types XLA stores densely; `None` for the rest
    /// (tokens, and types added to XLA after oxmoe's header).
    pub fn bits(self) -> Option<usize> {
        Some(match self.0 {
            sys::XLA_FFI_DataType_S1 | sys::XLA_FFI_DataType_U1 => 1,
            sys::XLA_FFI_DataType_S2 | sys::XLA_FFI_DataType_U2 => 2,
            sys::XLA_FFI_DataType_S4 | sys::XLA_FFI_DataType_U4 | sys::XLA_FFI_DataType_F4E2M1FN => 4,
            sys::XLA_FFI_DataType_PRED
            | sys::XLA_FFI_DataType_S8
            | sys::XLA_FFI_DataType_U8
            | sys::XLA_FFI_DataType_F8E5M2
            | sys::XLA_FFI_DataType_F8E3M4
            | sys::XLA_FFI_DataType_F8E4M3
            | sys::XLA_FFI_DataType_F8E4M3FN
            | sys::XLA_FFI_DataType_F8E4M3B11FNUZ
            | sys::XLA_FFI_DataType_F8E5M2FNUZ
            | sys::XLA_FFI_DataType_F8E4M3FNUZ
            | sys::XLA_FFI_DataType_F8E8M0FNU => 8,
            sys::XLA_FFI_DataType_S16 | sys::XLA_FFI_DataType_U16 | sys::XLA_FFI_DataType_F16 | sys::XLA_FFI_DataType_BF16 => 16,
            sys::XLA_FFI_DataType_S32 | sys::XLA_FFI_DataType_U32 | sys::XLA_FFI_DataType_F32 => 32,
            sys::XLA_FFI_DataType_S64 | sys::XLA_FFI_DataType_U64 | sys::XLA_FFI_DataType_F64 | sys::XLA_FFI_DataType_C64 => 64,
            sys::XLA_FFI_DataType_C128 => 128,
            _ => return None,
        })
    }

    /// The name JAX users know the type by.
    pub fn name(self) -> &'static str {
        match self.0 {
            sys::XLA_FFI_DataType_PRED => "bool",
            sys::XLA_FFI_DataType_S8 => "int8",
            sys::XLA_FFI_DataType_S16 => "int16",
            sys::XLA_FFI_DataType_S32 => "int32",
            sys::XLA_FFI_DataType_S64 => "int64",
            sys::XLA_FFI_DataType_U8 => "uint8",
            sys::XLA_FFI_DataType_U16 => "uint16",
            sys::XLA_FFI_DataType_U32 => "uint32",
            sys::XLA_FFI_DataType_U64 => "uint64",
            sys::XLA_FFI_DataType_F16 => "float16",
            sys::XLA_FFI_DataType_BF16 => "bfloat16",
            sys::XLA_FFI_DataType_F32 => "float32",
            sys::XLA_FFI_DataType_F64 => "float64",
            _ => "an unsupported type",
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
