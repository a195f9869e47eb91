//! The CPU quantization: the executable specification of
//! `oxmoe.fp8.quantize`, one block at a time.
//!
//! For each block of the result (of `x`'s batch element, or of its transpose):
//!
//! - float32 subnormals (below 2^-126 in magnitude) count as zeros of their
//!   sign (XLA:CPU's threads flush them, CUDA's `mul.ftz` does: decided here
//!   on the bits, so every backend agrees);
//! - `amax` is the largest magnitude; a NaN or an infinity makes the block NaN:
//!   its scale and every value;
//! - `scale = amax * (1 / 448)` (the reciprocal rounded to float32), or with
//!   power-of-two scales the smallest power of two at least that; a block
//!   whose `amax` is below `448 * 2^-126` (zeros, or magnitudes so small that
//!   the scale would not be a normal float32) has scale 1, its values zero;
//! - `value = e4m3(clamp(x * (1 / scale), -448, 448))`: the reciprocal
//!   correctly rounded, one float32 product, rounded to nearest even.
//!
//! An FP8 input (requantization: values and their 1 x 128 blocks' scales) is
//! [`dequantized`] first, as `oxmoe.fp8.dequantize` computes it on XLA:CPU.

use super::Quantization;
use crate::permutation::Entry;
use crate::real::{Real, E4m3};
use rayon::prelude::*;

/// `1 / 448` rounded to float32.
pub const INVERSE_E4M3_MAX: f32 = 1.0 / E4m3::MAX;
/// The smallest `amax` whose scale is a normal float32: `448 * 2^-126`, since
/// `448 * (1 / 448)`, rounded up, is at least 1.
pub const SMALLEST_SCALED_AMAX: f32 = E4m3::MAX * f32::MIN_POSITIVE;

/// `value`, a float32 subnormal replaced by a zero of its sign.
fn flushed(value: f32) -> f32 {
    if value.is_subnormal() {
        0f32.copysign(value)
    } else {
        value
    }
}

/// `a * b` in float32 as flush-to-zero arithmetic computes it (XLA:CPU's
/// threads, CUDA's `mul.ftz`): subnormal operands count as zeros of their
/// sign, and so does a product below 2^-126 in magnitude. The product is
/// exact in float64 and rounded once; it is decided tiny before rounding,
/// which for an FP8 value times a float32 (whose exact product has at most 28
/// significant bits, none within 2^-24 below a power of two) is the same as
/// after rounding, whichever the hardware does.
fn flushed_product(a: f32, b: f32) -> f32 {
    let exact = f64::from(flushed(a)) * f64::from(flushed(b));
    if exact.abs() < f64::from(f32::MIN_POSITIVE) {
        0f32.copysign(exact as f32)
    } else {
        exact as f32
    }
}

/// FP8 values `[..., C]` times their 1 x 128 blocks' `scales` (`[..., C /
/// 128]`: element `i`'s is `scales[i / 128]`), each product rounded to `T`:
/// `oxmoe.fp8.dequantize(q, T)`.
pub fn dequantized<T: Real>(values: &[E4m3], scales: &[f32]) -> Vec<T> {
    values.par_iter().enumerate().map(|(i, v)| dequantized_value(*v, scales[i / 128])).collect()
}

/// An FP8 value times its scale, rounded to `T`.
fn dequantized_value<T: Real>(value: E4m3, scale: f32) -> T {
    T::from_f32(flushed_product(value.to_f32(), scale))
}

/// [`dequantized`] of the FP8 rows (`cols` values each) that `source_rows`
/// names, in its order, gathered as the permutation's gathers do: x's row `r`
/// is the input's row `source_rows[r]` dequantized, zeros where the entry is
/// -1, NaNs where it is out of range ([`Entry`]).
pub fn dequantized_rows<T: Real>(values: &[E4m3], scales: &[f32], cols: usize, source_rows: &[i32]) -> Vec<T> {
    if cols == 0 {
        return Vec::new();
    }
    let rows = values.len() / cols;
    let mut x = vec![T::from_f32(0.0); source_rows.len() * cols];
    x.par_chunks_mut(cols).zip(source_rows.par_iter()).for_each(|(row, &entry)| match Entry::of(entry, rows) {
        Entry::At(i) => {
            let (values, scales) = (&values[i * cols..(i + 1) * cols], &scales[i * cols / 128..]);
            for (j, (x, &v)) in row.iter_mut().zip(values).enumerate() {
                *x = dequantized_value(v, scales[j / 128]);
            }
        }
        Entry::None => {}
        Entry::Invalid => row.fill(T::from_f32(f32::NAN)),
    });
    x
}

/// The smallest power of two at least `r`, a positive normal float32 (below
/// 2^127).
fn power_of_two_at_least(r: f32) -> f32 {
    let bits = r.to_bits();
    if bits & 0x7F_FFFF == 0 {
        r
    } else {
        f32::from_bits((bits & 0x7F80_0000) + 0x80_0000)
    }
}

/// The scale of a block: from its largest magnitude `amax`, or NaN when the
/// block is not `finite`.
pub fn block_scale(amax: f32, finite: bool, power_of_two: bool) -> f32 {
    if !finite {
        return f32::NAN;
    }
    if amax < SMALLEST_SCALED_AMAX {
        return 1.0;
    }
    let ratio = amax * INVERSE_E4M3_MAX;
    if power_of_two {
        power_of_two_at_least(ratio)
    } else {
        ratio
    }
}

/// `value` in its block of reciprocal scale `inverse`, as FP8.
pub fn quantized(value: f32, inverse: f32) -> E4m3 {
    E4m3::from_f32((flushed(value) * inverse).clamp(-E4m3::MAX, E4m3::MAX))
}

/// Quantizes `x [batch, rows, cols]` into `values` (`[batch, rows, cols]`, or
/// `[batch, cols, rows]` with `q.transpose`) and `scales` (one per block of
/// the values), by the module's semantics.
pub fn quantize<T: Real>(q: &Quantization, x: &[T], values: &mut [E4m3], scales: &mut [f32]) {
    if values.is_empty() {
        return;
    }
    let (rows, cols) = q.result_matrix();
    let (block_rows, block_cols) = (q.block.rows, q.block.cols);
    // Where element (i, j) of a batch element's result is in that element of x.
    let (row_stride, col_stride) = if q.transpose { (1, q.cols) } else { (q.cols, 1) };
    // A task per row of blocks: `block_rows` rows of values and their row of scales.
    let value_rows = values.par_chunks_mut(block_rows * cols);
    value_rows.zip(scales.par_chunks_mut(cols / block_cols)).enumerate().for_each(|(task, (values, scales))| {
        let (b, i0) = (task / (rows / block_rows), task % (rows / block_rows) * block_rows);
        let x = &x[b * q.rows * q.cols..][..q.rows * q.cols];
        for (block, scale) in scales.iter_mut().enumerate() {
            let j0 = block * block_cols;
            let (mut amax, mut finite) = (0f32, true);
            for i in i0..i0 + block_rows {
                for j in j0..j0 + block_cols {
                    let v = x[i * row_stride + j * col_stride].to_f32();
                    finite &= v.is_finite();
                    amax = amax.max(flushed(v).abs());
                }
            }
            *scale = block_scale(amax, finite, q.power_of_two_scales);
            let inverse = 1.0 / *scale;
            for i in i0..i0 + block_rows {
                for j in j0..j0 + block_cols {
                    values[(i - i0) * cols + j] = quantized(x[i * row_stride + j * col_stride].to_f32(), inverse);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize::Block;

    fn quantization(batch: usize, rows: usize, cols: usize, block: (usize, usize), transpose: bool) -> Quantization {
        let block = Block { rows: block.0, cols: block.1 };
        Quantization { batch, rows, cols, block, power_of_two_scales: false, transpose }
    }

    fn run(q: &Quantization, x: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let (rows, cols) = q.scales_matrix();
        let mut values = vec![E4m3(0xAA); x.len()];
        let mut scales = vec![-1f32; q.batch * rows * cols];
        quantize(q, x, &mut values, &mut scales);
        (values.iter().map(|v| v.0).collect(), scales)
    }

    #[test]
    fn the_constants_are_what_they_say() {
        assert_eq!(INVERSE_E4M3_MAX.to_bits(), 0x3B12_4925);
        assert_eq!(SMALLEST_SCALED_AMAX.to_bits(), 0x04E0_0000);
        // The smallest amax whose product with 1/448 is at least 2^-126, exactly.
        let exact = |a: f32| f64::from(a) * f64::from(INVERSE_E4M3_MAX) >= f64::from(f32::MIN_POSITIVE);
        assert!(exact(SMALLEST_SCALED_AMAX) && !exact(SMALLEST_SCALED_AMAX.next_down()));
    }

    #[test]
    fn scales_follow_the_largest_magnitude() {
        assert_eq!(block_scale(448.0, true, false), 448.0 * INVERSE_E4M3_MAX);
        assert_eq!(block_scale(3.0, true, true), 0.0078125); // 3 / 448 = 0.0067 -> 2^-7
        assert_eq!(block_scale(448.0 / 64.0, true, true), 1.0 / 64.0); // a power of two stays
        assert_eq!(block_scale(0.0, true, true), 1.0);
        assert_eq!(block_scale(SMALLEST_SCALED_AMAX.next_down(), true, false), 1.0);
        assert_eq!(block_scale(SMALLEST_SCALED_AMAX, true, false), SMALLEST_SCALED_AMAX * INVERSE_E4M3_MAX);
        assert!(block_scale(SMALLEST_SCALED_AMAX, true, false).is_normal());
        assert!(block_scale(1.0, false, false).is_nan());
        assert_eq!(block_scale(f32::MAX, true, true), 2f32.powi(120));
    }

    /// [2, 3] in 1 x 1 blocks would be trivial; in (1, 128) blocks the rows of a
    /// [1, 2, 128] input scale apart, and transposed the same values land in
    /// columns.
    #[test]
    fn transposed_values_and_scales_are_those_of_the_transpose() {
        let (rows, cols) = (128, 256);
        let x: Vec<f32> = (0..rows * cols).map(|k| ((k * 7919) % 1000) as f32 - 500.0).collect();
        let mut xt = vec![0f32; x.len()];
        for r in 0..rows {
            for c in 0..cols {
                xt[c * rows + r] = x[r * cols + c];
            }
        }
        for block in [(1, 128), (128, 128), (128, 1)] {
            let transposed = run(&quantization(1, rows, cols, block, true), &x);
            let of_transpose = run(&quantization(1, cols, rows, block, false), &xt);
            assert_eq!(transposed, of_transpose, "{block:?}");
        }
    }

    #[test]
    fn a_block_with_a_nan_or_an_infinity_is_nan_and_others_are_not() {
        for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = vec![1f32; 256];
            x[3] = special;
            let (values, scales) = run(&quantization(1, 2, 128, (1, 128), false), &x);
            assert!(scales[0].is_nan() && values[..128].iter().all(|&v| v & 0x7F == 0x7F), "{special}");
            assert_eq!(scales[1], INVERSE_E4M3_MAX);
            assert!(values[128..].iter().all(|&v| v == 0x7E), "{special}");
        }
    }

    #[test]
    fn dequantized_products_flush_below_the_normal_floats() {
        let scale = f32::from_bits(0x00FF_FFFF); // (2 - 2^-23) * 2^-126
        // 0.5 times it is (2 - 2^-23) * 2^-127: subnormal, though IEEE rounding would give 2^-126.
        assert_eq!(flushed_product(0.5, scale).to_bits(), 0);
        assert_eq!(flushed_product(-0.5, scale).to_bits(), 0x8000_0000);
        assert_eq!(flushed_product(1.0, scale), scale);
        assert_eq!(flushed_product(448.0, f32::MIN_POSITIVE / 2.0), 0.0); // a subnormal scale
        assert!(flushed_product(f32::NAN, 1.0).is_nan());
        let values = [E4m3::from_f32(2.0), E4m3::from_f32(-3.0), E4m3(0x7F)];
        let mut scales = vec![0.25f32, 1.0];
        let mut all = [values[0]; 256];
        (all[1], all[127], all[128]) = (values[1], values[2], values[1]);
        let got: Vec<f32> = dequantized(&all, &scales);
        assert_eq!((got[0], got[1], got[128], got[129]), (0.5, -0.75, -3.0, 2.0));
        assert!(got[127].is_nan());
        scales[1] = 1.0 / 3.0;
        let got: Vec<half::bf16> = dequantized(&all, &scales);
        assert_eq!(got[128], half::bf16::from_f32(-3.0 * (1.0f32 / 3.0)));
    }

    #[test]
    fn subnormals_count_as_zero_and_tiny_blocks_have_scale_one() {
        let tiny = f32::MIN_POSITIVE / 2.0;
        // A subnormal beside a normal value: zero, of its sign.
        let mut x = vec![0f32; 128];
        (x[0], x[1], x[2]) = (-tiny, tiny, 2f32.powi(-110));
        let (values, scales) = run(&quantization(1, 1, 128, (1, 128), false), &x);
        assert_eq!(scales[0], 2f32.powi(-110) * INVERSE_E4M3_MAX);
        assert_eq!(&values[..3], &[0x80, 0x00, 0x7E]);
        // Magnitudes below 448 * 2^-126: scale 1, values zero.
        x[2] = SMALLEST_SCALED_AMAX.next_down();
        let (values, scales) = run(&quantization(1, 1, 128, (1, 128), false), &x);
        assert_eq!(scales[0], 1.0);
        assert!(values.iter().all(|&v| v & 0x7F == 0));
    }
}
