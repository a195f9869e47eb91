//! The CPU activation: the executable specification of
//! `oxmoe.activation.activation_bwd` and of the hidden activation that
//! `oxmoe.grouped_gemm.ragged_dot_activation` applies to its product, one
//! row at a time.
//!
//! For row `r` of weight `p` and columns `j < F`, everything in float32 and
//! `round` the rounding to the arrays' type `T` (the identity for float32):
//!
//! - gated: `x = gate[r, j]`, `u = up[r, j]` (columns `j` and `F + j` of the
//!   pre-activation), `h = round(act(x) * u)`; otherwise `x` is column `j`
//!   and `h = round(act(x))`: the forward's hidden activation, as the layer's
//!   forward rounds it;
//! - `grad_row_probs[r] = Σ_j h * grad_hidden[r, j]` (in column order here;
//!   the CUDA kernel sums in another order, within float32 rounding);
//! - `c = round(grad_hidden[r, j] * p)`: the hidden activation's gradient
//!   after the routing weight, rounded as the layer rounds it;
//! - gated: `grad_gate = round(c * u * act'(x))`, `grad_up = round(c *
//!   act(x))`; otherwise `grad_x = round(c * act'(x))`;
//! - `weighted_hidden[r, j] = round(h * p)`.
//!
//! `act` is SiLU, `x * sigmoid(x)`, or GELU's tanh approximation, `x * (1 +
//! tanh(sqrt(2 / pi) * (x + 0.044715 x^3))) / 2`, with [`value_and_slope`]'s
//! formulas for the value and the derivative.

use super::Activation;
use crate::real::{unused_row_value, Real};
use rayon::prelude::*;

/// `sqrt(2 / pi)` and the cubic coefficient of GELU's tanh approximation.
const GELU_SCALE: f32 = 0.797_884_6;
const GELU_CUBIC: f32 = 0.044_715;

/// `(act(x), act'(x))` in float32: SiLU's `x s` and `s (1 + x min(e s, 1))`
/// with `e = e^-x` and `s = 1 / (1 + e)` (`e s` is `1 - s` without its
/// cancellation near `s = 1`; where `e` overflows, `s` is 0 and the `min`
/// takes 1), or GELU's `x (1 + t) / 2` and `(1 + t) / 2 + x (1 -
/// t^2) sqrt(2 / pi) (1 + 3 * 0.044715 x^2) / 2` with `t = tanh(sqrt(2 / pi)
/// (x + 0.044715 x^3))`. `kernels/activation.cu` computes the same.
pub fn value_and_slope(gelu: bool, x: f32) -> (f32, f32) {
    if gelu {
        let t = (GELU_SCALE * (x + GELU_CUBIC * x * x * x)).tanh();
        let value = 0.5 * x * (1.0 + t);
        let slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_SCALE * (1.0 + 3.0 * GELU_CUBIC * x * x);
        (value, slope)
    } else {
        let e = (-x).exp();
        let s = 1.0 / (1.0 + e);
        (x * s, s * (1.0 + x * (e * s).min(1.0)))
    }
}

fn round<T: Real>(value: f32) -> f32 {
    T::from_f32(value).to_f32()
}

/// The hidden activation of each row of `pre_activation [rows,
/// activation.input_columns(features)]` into `hidden [rows, features]`: the
/// module's `h`.
pub fn activation_fwd<T: Real>(activation: Activation, features: usize, pre_activation: &[T], hidden: &mut [T]) {
    if features == 0 {
        return;
    }
    let (gated, gelu) = (activation.gated(), activation.gelu());
    hidden.par_chunks_mut(features).zip(pre_activation.par_chunks(activation.input_columns(features))).for_each(
        |(hidden, pre)| {
            for j in 0..features {
                let (value, _) = value_and_slope(gelu, pre[j].to_f32());
                let up = if gated { pre[features + j].to_f32() } else { 1.0 };
                hidden[j] = T::from_f32(value * up);
            }
        },
    );
}

/// The rows of `rows` that groups of `group_sizes` cover, from the first:
/// negative sizes count as zero (as the grouped products count them,
/// `grouped_gemm::group_rows`) and the total stops at `rows`.
pub fn covered_rows(group_sizes: &[i32], rows: usize) -> usize {
    group_sizes.iter().fold(0, |covered, &size| (covered + size.max(0) as usize).min(rows))
}

/// The activation backward (see the module's semantics) of the rows of
/// `grad_hidden [rows, features]`, `pre_activation [rows,
/// activation.input_columns(features)]` and `row_probs [rows]`, into
/// `grad_pre_activation` (shaped as `pre_activation`), `weighted_hidden [rows,
/// features]` and `grad_row_probs [rows]`. With `group_sizes`, of the rows
/// they cover ([`covered_rows`]) only: the results' other rows are
/// unspecified ([`unused_row_value`]: NaN).
#[allow(clippy::too_many_arguments)]
pub fn activation_bwd<T: Real>(activation: Activation, features: usize, grad_hidden: &[T], pre_activation: &[T],
                               row_probs: &[f32], group_sizes: Option<&[i32]>, grad_pre_activation: &mut [T],
                               weighted_hidden: &mut [T], grad_row_probs: &mut [f32]) {
    let rows = group_sizes.map_or(row_probs.len(), |sizes| covered_rows(sizes, row_probs.len()));
    let width = activation.input_columns(features);
    grad_pre_activation[rows * width..].fill(unused_row_value(false));
    weighted_hidden[rows * features..].fill(unused_row_value(false));
    grad_row_probs[rows..].fill(unused_row_value(false));
    let grad_row_probs = &mut grad_row_probs[..rows];
    if features == 0 {
        grad_row_probs.fill(0.0);
        return;
    }
    let (gated, gelu) = (activation.gated(), activation.gelu());
    grad_row_probs
        .par_iter_mut()
        .zip(grad_pre_activation[..rows * width].par_chunks_mut(width))
        .zip(weighted_hidden[..rows * features].par_chunks_mut(features))
        .zip(grad_hidden.par_chunks(features).zip(pre_activation.par_chunks(width)).zip(row_probs.par_iter()))
        .for_each(|(((grad_prob, grad_pre), weighted), ((grad, pre), &p))| {
            let mut sum = 0f32;
            for j in 0..features {
                let (value, slope) = value_and_slope(gelu, pre[j].to_f32());
                // Ungated, `up` is 1: the products below are then exactly `value` and `c * slope`.
                let up = if gated { pre[features + j].to_f32() } else { 1.0 };
                let hidden = round::<T>(value * up);
                let g = grad[j].to_f32();
                sum += hidden * g;
                let c = round::<T>(g * p);
                grad_pre[j] = T::from_f32(c * up * slope);
                if gated {
                    grad_pre[features + j] = T::from_f32(c * value);
                }
                weighted[j] = T::from_f32(hidden * p);
            }
            *grad_prob = sum;
        });
}

#[cfg(test)]
mod tests {
    use super::{activation_bwd, covered_rows, value_and_slope};
    use crate::activation::Activation;

    /// The derivative formulas against central differences of the values in
    /// float64 arithmetic.
    #[test]
    fn slopes_are_the_derivatives_of_the_values() {
        for gelu in [false, true] {
            for &x in &[-6.0f32, -2.5, -1.0, -0.3, 0.0, 0.4, 1.0, 2.2, 5.0] {
                let h = 1e-3f32;
                let (up, _) = value_and_slope(gelu, x + h);
                let (down, _) = value_and_slope(gelu, x - h);
                let numeric = (f64::from(up) - f64::from(down)) / (2.0 * f64::from(h));
                let (_, slope) = value_and_slope(gelu, x);
                assert!((numeric - f64::from(slope)).abs() < 2e-3, "gelu {gelu}, x {x}: {numeric} vs {slope}");
            }
        }
    }

    /// With group sizes, the rows they cover are the call's without them, bit
    /// for bit, and every other row of the results is NaN (unspecified, made visible).
    #[test]
    fn rows_past_the_groups_are_nan() {
        const SENTINEL: f32 = -12345.5;
        let (rows, features) = (7, 5);
        for activation in Activation::ALL {
            let width = activation.input_columns(features);
            let grad: Vec<f32> = (0..rows * features).map(|i| (i * 37 % 11) as f32 * 0.3 - 1.5).collect();
            let pre: Vec<f32> = (0..rows * width).map(|i| (i * 53 % 17) as f32 * 0.4 - 3.2).collect();
            let probs: Vec<f32> = (0..rows).map(|r| 0.1 * (r + 1) as f32).collect();
            let run = |group_sizes: Option<&[i32]>| {
                let mut results = [vec![SENTINEL; rows * width], vec![SENTINEL; rows * features], vec![SENTINEL; rows]];
                let [grad_pre, weighted, grad_probs] = &mut results;
                activation_bwd::<f32>(activation, features, &grad, &pre, &probs, group_sizes, grad_pre, weighted,
                                      grad_probs);
                results
            };
            let every_row = run(None);
            assert!(every_row.iter().flatten().all(|&v| v != SENTINEL), "{activation:?}: a row left unwritten");
            // Negative sizes count as zero, and a total past the rows stops at them.
            for (sizes, covered) in [(&[2, -3, 3][..], 5), (&[0, 0], 0), (&[4, 0, 9], rows)] {
                assert_eq!(covered_rows(sizes, rows), covered, "{sizes:?}");
                for ((got, want), columns) in run(Some(sizes)).iter().zip(&every_row).zip([width, features, 1]) {
                    let (inside, past) = got.split_at(covered * columns);
                    let same_bits = inside.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same_bits, "{activation:?}, {sizes:?}: a covered row differs");
                    let nan = past.iter().all(|v| v.is_nan());
                    assert!(nan, "{activation:?}, {sizes:?}: a row past the groups not NaN");
                }
            }
        }
    }
}
