//! Floating-point element types the kernels read and write, computed in f32.

use crate::ffi::Element;
use half::{bf16, f16};

/// A float element type whose arithmetic oxmoe does in f32.
pub trait Real: Element {
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
}

impl Real for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl Real for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
}

impl Real for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        f16::from_f32(value)
    }
}

/// A `float8_e4m3fn` value (its bits): sign, 4 exponent bits of bias 7, 3
/// mantissa bits; no infinities, `S.1111.111` is NaN, 448 the largest finite.
/// Only read: oxmoe quantizes in JAX (`oxmoe.fp8.quantize`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct E4m3(pub u8);

// SAFETY: one byte, any bit pattern valid, as XLA's F8E4M3FN.
unsafe impl Element for E4m3 {
    const DTYPE: crate::ffi::DataType = crate::ffi::DataType::F8E4M3FN;
}

/// Every `float8_e4m3fn` pattern's value, exactly (each is a float32).
const E4M3_VALUES: [f32; 256] = {
    let mut values = [0f32; 256];
    let mut bits = 0;
    while bits < 256 {
        let (exponent, mantissa) = ((bits >> 3) & 0xF, bits & 7);
        let magnitude = if exponent == 0xF && mantissa == 7 {
            f32::NAN
        } else if exponent == 0 {
            mantissa as f32 / 512.0 // mantissa / 8 * 2^-6
        } else {
            // (1 + mantissa / 8) * 2^(exponent - 7), built from its float32 bits.
            f32::from_bits(((exponent + 120) << 23 | mantissa << 20) as u32)
        };
        values[bits] = if bits & 0x80 != 0 { -magnitude } else { magnitude };
        bits += 1;
    }
    values
};

impl E4m3 {
    pub fn to_f32(self) -> f32 {
        E4M3_VALUES[self.0 as usize]
    }
}

/// The float types activations and router logits may have.
pub const FLOAT_TYPES: [crate::ffi::DataType; 3] =
    [crate::ffi::DataType::F32, crate::ffi::DataType::BF16, crate::ffi::DataType::F16];

/// `(rows, columns)` of a float matrix argument.
pub fn float_matrix(arg: &crate::ffi::Arg) -> crate::ffi::Result<(usize, usize)> {
    arg.expect_dtype(&FLOAT_TYPES)?;
    arg.matrix()
}

/// Runs `$body` with `$t` bound to the Rust type of the float dtype `$dtype`
/// (one of [`FLOAT_TYPES`]).
#[macro_export]
macro_rules! with_real_type {
    ($dtype:expr, $t:ident => $body:expr) => {{
        match $dtype {
            $crate::ffi::DataType::F32 => {
                type $t = f32;
                $body
            }
            $crate::ffi::DataType::BF16 => {
                type $t = half::bf16;
                $body
            }
            $crate::ffi::DataType::F16 => {
                type $t = half::f16;
                $body
            }
            other => $crate::invalid!("unsupported float dtype {other}"),
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::E4m3;

    #[test]
    fn e4m3_decodes_every_kind_of_pattern() {
        let cases = [
            (0x00, 0.0), (0x80, -0.0), (0x01, 2f32.powi(-9)), (0x07, 7.0 / 512.0), (0x08, 2f32.powi(-6)),
            (0x38, 1.0), (0x39, 1.125), (0xB8, -1.0), (0x7E, 448.0), (0xFE, -448.0), (0x40, 2.0), (0x3F, 1.875),
        ];
        for (bits, value) in cases {
            let got = E4m3(bits).to_f32();
            assert!(got == value && got.is_sign_negative() == value.is_sign_negative(), "{bits:#04x}: {got}");
        }
        assert!(E4m3(0x7F).to_f32().is_nan() && E4m3(0xFF).to_f32().is_nan());
        assert_eq!((0..=255u8).filter(|&b| E4m3(b).to_f32().is_nan()).count(), 2);
    }
}
