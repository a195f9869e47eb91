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
    /// The largest finite value.
    pub const MAX: f32 = 448.0;

    pub fn to_f32(self) -> f32 {
        E4M3_VALUES[self.0 as usize]
    }

    /// `value` rounded to the nearest `float8_e4m3fn`, ties to the even
    /// pattern; magnitudes past 448 (infinities too) saturate to ±448, as
    /// CUDA's `__NV_SATFINITE` conversion does, and NaN stays NaN (its sign
    /// kept). Decided on the bits, so a thread that flushes float32
    /// subnormals (XLA:CPU's do) rounds alike: they all round to zero.
    pub fn from_f32(value: f32) -> Self {
        const SMALLEST_NORMAL: u32 = 0x3C80_0000; // 2^-6
        const MAX_BITS: u32 = 0x43E0_0000; // 448
        let bits = value.to_bits();
        let sign = (bits >> 24) as u8 & 0x80;
        let magnitude = bits & 0x7FFF_FFFF;
        if magnitude > 0x7F80_0000 {
            return Self(sign | 0x7F);
        }
        if magnitude >= MAX_BITS {
            return Self(sign | 0x7E);
        }
        if magnitude < SMALLEST_NORMAL {
            // Subnormals are the multiples of 2^-9 below 2^-6; 8 steps is 2^-6,
            // whose pattern 0x08 follows 0x07.
            let steps = (f32::from_bits(magnitude) * 512.0).round_ties_even();
            return Self(sign | steps as u8);
        }
        // Round the float32 mantissa to its top 3 bits, ties to even: a carry
        // out of the mantissa moves the exponent up, as it should.
        let rounded = magnitude + 0x7_FFFF + (magnitude >> 20 & 1);
        let exponent = (rounded >> 23) - 120; // rebiased from 127 to 7
        Self(sign | (exponent << 3 | rounded >> 20 & 7) as u8)
    }
}

/// What the CPU writes on the rows a call may leave unwritten (a buffer's rows
/// past its groups): zero where the call zeroes them (`zero_unused_rows`),
/// else NaN. Their values are then unspecified on both backends, and a caller
/// that read one would carry the NaN into its results, so the callers' CPU
/// tests show it (the GPU leaves them as the buffer held them).
pub fn unused_row_value<T: Real>(zero_unused_rows: bool) -> T {
    T::from_f32(if zero_unused_rows { 0.0 } else { f32::NAN })
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

    fn encode(value: f32) -> u8 {
        E4m3::from_f32(value).0
    }

    /// Every finite pattern is its own value's encoding, of either sign.
    #[test]
    fn e4m3_encodes_every_value_as_itself() {
        for bits in 0..=0x7Eu8 {
            let value = E4m3(bits).to_f32();
            assert_eq!(encode(value), bits, "{value}");
            assert_eq!(encode(-value), bits | 0x80, "-{value}");
        }
    }

    /// Between each pair of neighbours: the midpoint goes to the even pattern,
    /// a float32 step either side of it to the nearer neighbour.
    #[test]
    fn e4m3_rounds_to_nearest_with_ties_to_even() {
        for bits in 0..0x7Eu8 {
            let (low, high) = (E4m3(bits).to_f32(), E4m3(bits + 1).to_f32());
            let midpoint = (low + high) / 2.0; // at most 5 significant bits: exact
            assert!(midpoint > low && midpoint < high);
            let even = if bits % 2 == 0 { bits } else { bits + 1 };
            for sign in [1.0f32, -1.0] {
                let s = if sign < 0.0 { 0x80 } else { 0 };
                assert_eq!(encode(sign * midpoint), even | s, "{midpoint}");
                assert_eq!(encode(sign * midpoint.next_down()), bits | s, "below {midpoint}");
                assert_eq!(encode(sign * midpoint.next_up()), (bits + 1) | s, "above {midpoint}");
            }
        }
    }

    #[test]
    fn e4m3_saturates_past_448_and_keeps_nan() {
        for value in [448.0f32.next_up(), 464.0, 480.0, 1e30, f32::MAX, f32::INFINITY] {
            assert_eq!(encode(value), 0x7E, "{value}");
            assert_eq!(encode(-value), 0xFE, "-{value}");
        }
        assert_eq!(encode(f32::NAN), 0x7F);
        assert_eq!(encode(-f32::NAN), 0xFF);
    }

    #[test]
    fn e4m3_rounds_what_lies_below_half_its_smallest_subnormal_to_zero() {
        let half_step = 2f32.powi(-10); // between 0 and 2^-9: the even pattern, zero
        for value in [half_step, half_step.next_down(), 1e-30, f32::MIN_POSITIVE, f32::from_bits(1), 0.0] {
            assert_eq!(encode(value), 0x00, "{value}");
            assert_eq!(encode(-value), 0x80, "-{value}");
        }
        assert_eq!(encode(half_step.next_up()), 0x01);
    }

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
