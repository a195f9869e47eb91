use std::fmt;
use xla_ffi_sys as sys;

/// The element type of a buffer or scalar attribute, as XLA names it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DataType(pub(crate) sys::XLA_FFI_DataType);

impl DataType {
    pub const PRED: Self = Self(sys::XLA_FFI_DataType_PRED);
    pub const U8: Self = Self(sys::XLA_FFI_DataType_U8);
    pub const S32: Self = Self(sys::XLA_FFI_DataType_S32);
    pub const S64: Self = Self(sys::XLA_FFI_DataType_S64);
    pub const F16: Self = Self(sys::XLA_FFI_DataType_F16);
    pub const BF16: Self = Self(sys::XLA_FFI_DataType_BF16);
    pub const F32: Self = Self(sys::XLA_FFI_DataType_F32);
    pub const F8E4M3FN: Self = Self(sys::XLA_FFI_DataType_F8E4M3FN);

    /// Bytes per element of the types oxmoe's handlers take; `None` for the
    /// rest, which every handler refuses.
    pub fn size(self) -> Option<usize> {
        match self {
            Self::PRED | Self::U8 | Self::F8E4M3FN => Some(1),
            Self::F16 | Self::BF16 => Some(2),
            Self::S32 | Self::F32 => Some(4),
            Self::S64 => Some(8),
            _ => None,
        }
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
            sys::XLA_FFI_DataType_F8E4M3FN => "float8_e4m3fn",
            _ => "an unsupported type",
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
