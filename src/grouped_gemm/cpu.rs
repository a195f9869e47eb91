//! CPU implementations of the grouped products: the executable specification.
//! Arithmetic is f32 (each product summed in increasing order of the
//! contracted index); rows outside every group of the window are zero.

use super::{group_rows, GroupedShape};
use crate::real::Real;
use rayon::prelude::*;

/// Output rows (or, transposed, output rows of a group's `[K, N]` block) per
/// parallel task: enough work to amortise scheduling.
const ROWS_PER_TASK: usize = 8;

/// `out[r] = lhs[r] · w_g` for each row `r` of local group `g`, where `w_g` is
/// `rhs[g]` (`[K, N]`) or, with `rhs_transposed`, `rhs[g]ᵀ` (`rhs[g]` is
/// `[N, K]`). Every other row of `out` is zero.
pub fn ragged_dot<T: Real, O: Real>(
    shape: &GroupedShape,
    lhs: &[T],
    rhs: &[T],
    rhs_transposed: bool,
    group_sizes: &[i32],
    group_offset: i32,
    out: &mut [O],
) {
    let (k, n) = (shape.k, shape.n);
    out.fill(O::from_f32(0.0));
    if n == 0 {
        return;
    }
    for (g, (start, end)) in group_rows(group_sizes, group_offset, shape.local_groups, shape.m).into_iter().enumerate() {
        if start == end || k == 0 {
            continue;  // rows stay zero
        }
        // The group's weights as f32, converted once for all its rows.
        let w: Vec<f32> = rhs[g * k * n..(g + 1) * k * n].iter().map(|x| x.to_f32()).collect();
        out[start * n..end * n].par_chunks_mut(ROWS_PER_TASK * n).enumerate().for_each(|(task, rows)| {
            let mut acc = vec![0f32; n];
            let mut row_f32 = vec![0f32; k];
            for (i, out_row) in rows.chunks_mut(n).enumerate() {
                let row = start + task * ROWS_PER_TASK + i;
                for (a, x) in row_f32.iter_mut().zip(&lhs[row * k..(row + 1) * k]) {
                    *a = x.to_f32();
                }
                if rhs_transposed {
                    // w is [N, K]: each output is a dot product along a row of w.
                    for (sum, w_row) in acc.iter_mut().zip(w.chunks(k)) {
                        *sum = row_f32.iter().zip(w_row).fold(0.0, |s, (&a, &b)| s + a * b);
                    }
                } else {
                    // w is [K, N]: add row k of w, scaled, for k in order.
                    acc.fill(0.0);
                    for (&a, w_row) in row_f32.iter().zip(w.chunks(n)) {
                        for (sum, &b) in acc.iter_mut().zip(w_row) {
                            *sum += a * b;
                        }
                    }
                }
                for (o, &sum) in out_row.iter_mut().zip(&acc) {
                    *o = O::from_f32(sum);
                }
            }
        });
    }
}

/// `out[g] = lhs_gᵀ · rhs_g` (`[K, N]`), summed over the rows of local group
/// `g` of `lhs` (`[M, K]`) and `rhs` (`[M, N]`); an empty group gives zeros.
pub fn transposed_ragged_dot<T: Real, O: Real>(
    shape: &GroupedShape,
    lhs: &[T],
    rhs: &[T],
    group_sizes: &[i32],
    group_offset: i32,
    out: &mut [O],
) {
    let (k, n) = (shape.k, shape.n);
    if k * n == 0 {
        return;
    }
    let groups = group_rows(group_sizes, group_offset, shape.local_groups, shape.m);
    for (block, &(start, end)) in out.chunks_mut(k * n).zip(&groups) {
        let rhs_rows: Vec<f32> = rhs[start * n..end * n].iter().map(|x| x.to_f32()).collect();
        block.par_chunks_mut(ROWS_PER_TASK * n).enumerate().for_each(|(task, out_rows)| {
            let first = task * ROWS_PER_TASK;
            let mut acc = vec![0f32; out_rows.len()];
            for (r, rhs_row) in (start..end).zip(rhs_rows.chunks(n)) {
                for (i, acc_row) in acc.chunks_mut(n).enumerate() {
                    let a = lhs[r * k + first + i].to_f32();
                    for (sum, &b) in acc_row.iter_mut().zip(rhs_row) {
                        *sum += a * b;
                    }
                }
            }
            for (o, &sum) in out_rows.iter_mut().zip(&acc) {
                *o = O::from_f32(sum);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 3-row, 2-group case worked by hand: group 0 holds row 0, group 1 rows
    /// 1..3, row 3 is in no group.
    #[test]
    fn small_case_by_hand() {
        let shape = GroupedShape { m: 4, k: 2, n: 1, groups: 2, local_groups: 2 };
        let lhs = [1f32, 2., 3., 4., 5., 6., 7., 8.];
        let rhs = [10f32, 1., 100., 1000.];
        let mut out = [9f32; 4];
        ragged_dot(&shape, &lhs, &rhs, false, &[1, 2], 0, &mut out);
        assert_eq!(out, [12., 4300., 6500., 0.]);

        let shape = GroupedShape { m: 4, k: 2, n: 1, groups: 2, local_groups: 2 };
        let mut grad = [9f32; 4];
        transposed_ragged_dot(&shape, &lhs, &[1f32, 1., 2., 5.], &[1, 2], 0, &mut grad);
        assert_eq!(grad, [1., 2., 3. + 10., 4. + 12.]);
    }

    #[test]
    fn transposed_weights_match() {
        let shape = GroupedShape { m: 2, k: 3, n: 2, groups: 1, local_groups: 1 };
        let lhs = [1f32, 2., 3., -1., 0., 1.];
        let (w, w_t) = ([1f32, 2., 3., 4., 5., 6.], [1f32, 3., 5., 2., 4., 6.]);
        let (mut a, mut b) = ([0f32; 4], [0f32; 4]);
        ragged_dot(&shape, &lhs, &w, false, &[2], 0, &mut a);
        ragged_dot(&shape, &lhs, &w_t, true, &[2], 0, &mut b);
        assert_eq!(a, [22., 28., 4., 4.]);
        assert_eq!(a, b);
    }
}
