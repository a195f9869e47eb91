//! CPU implementation of the activation: the executable specification.
//! Arithmetic is f32; each result is rounded once to the element type.
//!
//! Rows `[0, covered)` are computed; the rest are zero (see the module).

use super::Activation;
use crate::real::Real;
use rayon::prelude::*;

/// Rows per parallel task: enough work to amortise scheduling.
const ROWS_PER_TASK: usize = 16;

/// `sqrt(2 / pi)` and the cubic coefficient of the tanh approximation of GELU.
const GELU_SCALE: f32 = 0.797_884_6;
const GELU_CUBIC: f32 = 0.044_715;

/// The activation of `x` and its derivative.
pub fn activate(x: f32, gelu: bool) -> (f32, f32) {
    if gelu {
        let inner = GELU_SCALE * (x + GELU_CUBIC * x * x * x);
        let t = inner.tanh();
        let value = 0.5 * x * (1.0 + t);
        let slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_SCALE * (1.0 + 3.0 * GELU_CUBIC * x * x);
        (value, slope)
    } else {
        let s = 1.0 / (1.0 + (-x).exp());
        (x * s, s * (1.0 + x * (1.0 - s)))
    }
}

/// `hidden [rows, width]` of `up [rows, up_width]`.
pub fn forward<T: Real>(activation: Activation, up: &[T], width: usize, covered: usize, hidden: &mut [T]) {
    let up_width = if activation.glu { 2 * width } else { width };
    hidden.par_chunks_mut(width * ROWS_PER_TASK).enumerate().for_each(|(task, out)| {
        for (i, out_row) in out.chunks_mut(width).enumerate() {
            let row = task * ROWS_PER_TASK + i;
            if row >= covered {
                out_row.fill(T::from_f32(0.0));
                continue;
            }
            let up_row = &up[row * up_width..][..up_width];
            for (c, out) in out_row.iter_mut().enumerate() {
                let (a, _) = activate(up_row[c].to_f32(), activation.gelu);
                let linear = if activation.glu { up_row[width + c].to_f32() } else { 1.0 };
                *out = T::from_f32(a * linear);
            }
        }
    });
}

/// `grad_up [rows, up_width]` and `hidden [rows, width]` (the forward's) of
/// `up` and `grad_hidden [rows, width]`.
pub fn backward<T: Real>(
    activation: Activation,
    up: &[T],
    grad_hidden: &[T],
    width: usize,
    covered: usize,
    grad_up: &mut [T],
    hidden: &mut [T],
) {
    let up_width = if activation.glu { 2 * width } else { width };
    let tasks = grad_up.par_chunks_mut(up_width * ROWS_PER_TASK).zip(hidden.par_chunks_mut(width * ROWS_PER_TASK));
    tasks.enumerate().for_each(|(task, (grad_out, hidden_out))| {
        for (i, (grad_row, hidden_row)) in grad_out.chunks_mut(up_width).zip(hidden_out.chunks_mut(width)).enumerate() {
            let row = task * ROWS_PER_TASK + i;
            if row >= covered {
                grad_row.fill(T::from_f32(0.0));
                hidden_row.fill(T::from_f32(0.0));
                continue;
            }
            let up_row = &up[row * up_width..][..up_width];
            let grad_hidden_row = &grad_hidden[row * width..][..width];
            for c in 0..width {
                let (a, slope) = activate(up_row[c].to_f32(), activation.gelu);
                let dh = grad_hidden_row[c].to_f32();
                if activation.glu {
                    let linear = up_row[width + c].to_f32();
                    hidden_row[c] = T::from_f32(a * linear);
                    grad_row[c] = T::from_f32(dh * linear * slope);
                    grad_row[width + c] = T::from_f32(dh * a);
                } else {
                    hidden_row[c] = T::from_f32(a);
                    grad_row[c] = T::from_f32(dh * slope);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_derivatives_match_central_differences() {
        for gelu in [false, true] {
            for x in [-6.0f64, -2.5, -0.7, 0.0, 0.3, 1.9, 7.0] {
                let h = 1e-3;
                let f = |x: f64| activate(x as f32, gelu).0 as f64;
                let numeric = (f(x + h) - f(x - h)) / (2.0 * h);
                let (_, slope) = activate(x as f32, gelu);
                assert!((slope as f64 - numeric).abs() < 2e-3, "gelu={gelu} x={x}: {slope} against {numeric}");
            }
        }
    }

    #[test]
    fn rows_past_the_covered_ones_are_zero_and_the_rest_gated() {
        let activation = Activation { glu: true, gelu: false };
        let up = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut hidden = [f32::NAN; 3];
        forward(activation, &up, 1, 2, &mut hidden);
        let silu = |x: f32| x * (1.0 / (1.0 + (-x).exp()));
        assert_eq!(hidden, [silu(1.0) * 2.0, silu(3.0) * 4.0, 0.0]);
    }
}
