//! CPU implementations of the grouped products: the executable specification.
//! Arithmetic is f32 (each product summed in increasing order of the
//! contracted index); rows outside every group of the window are zero (or,
//! where a call asks, left unwritten).

use super::ops::FP8_BLOCK;
use super::{group_rows, GroupedShape};
use crate::activation::{self, Activation};
use crate::real::{unused_row_value, Real, E4m3};
use rayon::prelude::*;
use std::ops::Range;

/// Rows of one tile: the output rows that one pass over the contracted index
/// computes together, so each weight row loaded serves all of them.
const TILE_ROWS: usize = 4;
/// Columns of one tile: 4 × 16 f32 accumulators stay in AVX registers.
const TILE_COLS: usize = 16;
/// Tiles per parallel task: enough work to amortise scheduling.
const TILES_PER_TASK: usize = 2;

/// A tile's operand from the ragged side: for each step `p` of the contracted
/// index, the values of the tile's rows.
type Panel = Vec<[f32; TILE_ROWS]>;

/// `acc[t][c] = Σ_p panel[p][t] · b[p · stride + col + c]`, summed in increasing
/// order of `p` (the specification's order).
#[inline(always)]
fn tile_sum<const C: usize>(panel: &[[f32; TILE_ROWS]], b: &[f32], stride: usize, col: usize) -> [[f32; C]; TILE_ROWS] {
    let mut acc = [[0f32; C]; TILE_ROWS];
    for (p, a) in panel.iter().enumerate() {
        let b_row: &[f32; C] = b[p * stride + col..][..C].try_into().unwrap();
        for (acc_row, &a_t) in acc.iter_mut().zip(a) {
            for (sum, &b_c) in acc_row.iter_mut().zip(b_row) {
                *sum += a_t * b_c;
            }
        }
    }
    acc
}

/// `out[t · n + j] = Σ_p panel[p][t] · b[p · n + j]` for the tile's rows `t` and
/// every column `j` of the row-major `[P, n]` matrix `b`.
#[inline(always)]
fn panel_product_portable(panel: &[[f32; TILE_ROWS]], b: &[f32], n: usize, out: &mut [f32]) {
    let full = n - n % TILE_COLS;
    for col in (0..full).step_by(TILE_COLS) {
        for (t, row) in tile_sum::<TILE_COLS>(panel, b, n, col).iter().enumerate() {
            out[t * n + col..][..TILE_COLS].copy_from_slice(row);
        }
    }
    for col in full..n {
        for (t, row) in tile_sum::<1>(panel, b, n, col).iter().enumerate() {
            out[t * n + col] = row[0];
        }
    }
}

/// The same loops compiled for AVX2 (twice the lanes of the x86-64 baseline);
/// without FMA, so every product and sum rounds as on the portable path.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn panel_product_avx2(panel: &[[f32; TILE_ROWS]], b: &[f32], n: usize, out: &mut [f32]) {
    panel_product_portable(panel, b, n, out)
}

fn panel_product(panel: &[[f32; TILE_ROWS]], b: &[f32], n: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { panel_product_avx2(panel, b, n, out) };
    }
    panel_product_portable(panel, b, n, out)
}

/// The rows the local groups `groups` cover (each starts where the one
/// before ends): `[bounds[0], bounds[local_groups])`, empty without groups.
fn window_rows(groups: &[(usize, usize)]) -> Range<usize> {
    match (groups.first(), groups.last()) {
        (Some(&(start, _)), Some(&(_, end))) => start..end,
        _ => 0..0,
    }
}

/// Fills the rows of the row-major `matrix` (`columns` wide) outside `window`
/// with zeros, or with `zero_unused_rows` false NaN ([`unused_row_value`]).
fn fill_rows_outside<O: Real>(matrix: &mut [O], columns: usize, window: &Range<usize>, zero_unused_rows: bool) {
    let (before, rest) = matrix.split_at_mut(window.start * columns);
    before.fill(unused_row_value(zero_unused_rows));
    rest[window.len() * columns..].fill(unused_row_value(zero_unused_rows));
}

/// `out[r] = lhs[r] · w_g` for each row `r` of local group `g`, where `w_g` is
/// `rhs[g]` (`[K, N]`) or, with `rhs_transposed`, `rhs[g]ᵀ` (`rhs[g]` is
/// `[N, K]`). Every other row of `out` is zero with `zero_unused_rows`, else
/// unspecified ([`unused_row_value`]).
#[allow(clippy::too_many_arguments)]
pub fn ragged_dot<T: Real, O: Real>(
    shape: &GroupedShape,
    lhs: &[T],
    rhs: &[T],
    rhs_transposed: bool,
    group_sizes: &[i32],
    group_offset: i32,
    zero_unused_rows: bool,
    out: &mut [O],
) {
    let (k, n) = (shape.k, shape.n);
    let groups = group_rows(group_sizes, group_offset, shape.local_groups, shape.m);
    let window = window_rows(&groups);
    fill_rows_outside(out, n, &window, zero_unused_rows);
    if n == 0 || k == 0 {
        out[window.start * n..window.end * n].fill(O::from_f32(0.0));  // nothing to sum: zero products
        return;
    }
    for (g, (start, end)) in groups.into_iter().enumerate() {
        // The group's weights as f32 [K, N], converted (and transposed) once for all its rows.
        let group = &rhs[g * k * n..(g + 1) * k * n];
        let w: Vec<f32> = if rhs_transposed {
            (0..k * n).map(|i| group[(i % n) * k + i / n].to_f32()).collect()
        } else {
            group.iter().map(|x| x.to_f32()).collect()
        };
        out[start * n..end * n].par_chunks_mut(TILES_PER_TASK * TILE_ROWS * n).enumerate().for_each(|(task, rows)| {
            let mut panel: Panel = vec![[0f32; TILE_ROWS]; k];
            let mut tile = vec![0f32; TILE_ROWS * n];
            for (i, out_rows) in rows.chunks_mut(TILE_ROWS * n).enumerate() {
                let first = start + (task * TILES_PER_TASK + i) * TILE_ROWS;
                let count = out_rows.len() / n;
                for (p, a) in panel.iter_mut().enumerate() {
                    for (t, a_t) in a.iter_mut().enumerate() {
                        *a_t = if t < count { lhs[(first + t) * k + p].to_f32() } else { 0.0 };
                    }
                }
                panel_product(&panel, &w, n, &mut tile);
                for (o, &sum) in out_rows.iter_mut().zip(&tile) {
                    *o = O::from_f32(sum);
                }
            }
        });
    }
}

/// [`ragged_dot`]'s product (rhs `[Gl, K, N]`) into `pre_activation [M, N]`
/// and its `activation`, row by row, into `hidden [M, F]`: over the window's
/// rows; the other rows of both are zero with `zero_unused_rows`, else
/// unspecified ([`unused_row_value`]).
#[allow(clippy::too_many_arguments)]
pub fn ragged_dot_activation<T: Real>(
    shape: &GroupedShape,
    lhs: &[T],
    rhs: &[T],
    activation: Activation,
    group_sizes: &[i32],
    group_offset: i32,
    zero_unused_rows: bool,
    pre_activation: &mut [T],
    hidden: &mut [T],
) {
    ragged_dot::<T, T>(shape, lhs, rhs, false, group_sizes, group_offset, zero_unused_rows, pre_activation);
    let (n, features) = (shape.n, activation.hidden_columns(shape.n));
    let window = window_rows(&group_rows(group_sizes, group_offset, shape.local_groups, shape.m));
    fill_rows_outside(hidden, features, &window, zero_unused_rows);
    activation::cpu::activation_fwd::<T>(activation, features, &pre_activation[window.start * n..window.end * n],
                                         &mut hidden[window.start * features..window.end * features]);
}

/// Each chunk's [`group_rows`] (chunk `c` has `rows[c]` rows and the sizes
/// `group_sizes[c]` of the row-major `[C, G]` sizes).
fn chunk_group_rows(shape: &GroupedShape, rows: impl Iterator<Item = usize>, group_sizes: &[i32], group_offset: i32)
                    -> Vec<Vec<(usize, usize)>> {
    rows.zip(group_sizes.chunks(shape.groups.max(1)))
        .map(|(m, sizes)| group_rows(sizes, group_offset, shape.local_groups, m))
        .collect()
}

/// One chunk of a transposed product's rows: `lhs [rows, K]`, `rhs [rows, N]`.
pub struct ChunkRows<'s, T> {
    pub lhs: &'s [T],
    pub rhs: &'s [T],
    pub rows: usize,
}

/// `out[g] = lhs_gᵀ · rhs_g` (`[K, N]`), summed over the rows of local group
/// `g` in each chunk, chunk after chunk (the chunks' `[C, G]` sizes are
/// `group_sizes`, row-major); an empty group gives zeros.
pub fn transposed_ragged_dot<T: Real, O: Real>(
    shape: &GroupedShape,
    chunks: &[ChunkRows<T>],
    group_sizes: &[i32],
    group_offset: i32,
    out: &mut [O],
) {
    let (k, n) = (shape.k, shape.n);
    if k * n == 0 {
        return;
    }
    let bounds = chunk_group_rows(shape, chunks.iter().map(|c| c.rows), group_sizes, group_offset);
    for (g, block) in out.chunks_mut(k * n).enumerate() {
        // The group's rows, chunk after chunk: (chunk, row) in the order they are summed.
        let rows: Vec<(&ChunkRows<T>, usize)> =
            chunks.iter().zip(&bounds).flat_map(|(chunk, b)| (b[g].0..b[g].1).map(move |r| (chunk, r))).collect();
        let rhs_rows: Vec<f32> = rows.iter().flat_map(|&(c, r)| c.rhs[r * n..(r + 1) * n].iter().map(|x| x.to_f32())).collect();
        block.par_chunks_mut(TILES_PER_TASK * TILE_ROWS * n).enumerate().for_each(|(task, out_rows)| {
            let mut panel: Panel = vec![[0f32; TILE_ROWS]; rows.len()];
            let mut tile = vec![0f32; TILE_ROWS * n];
            for (i, tile_rows) in out_rows.chunks_mut(TILE_ROWS * n).enumerate() {
                // Output rows are columns of lhs: the tile's rows are lhs[r, first..first + count].
                let first = (task * TILES_PER_TASK + i) * TILE_ROWS;
                let count = tile_rows.len() / n;
                for (&(c, r), a) in rows.iter().zip(panel.iter_mut()) {
                    for (t, a_t) in a.iter_mut().enumerate() {
                        *a_t = if t < count { c.lhs[r * k + first + t].to_f32() } else { 0.0 };
                    }
                }
                panel_product(&panel, &rhs_rows, n, &mut tile);
                for (o, &sum) in tile_rows.iter_mut().zip(&tile) {
                    *o = O::from_f32(sum);
                }
            }
        });
    }
}

// -- FP8 -------------------------------------------------------------------------------

/// `out[r] = Σ_b partial_b[r] * (lhs_scales[r, b] * scale of rhs block (b, n / 128))`
/// for each row `r` of local group `g`, where `partial_b` is the f32 sum (in
/// increasing order of the contracted index) of the FP8 products over the
/// `b`-th 128 of K, the blocks added in order; `w_g` is `rhs[g]` (`[K, N]`,
/// scales `[K/128, N/128]`) or with `rhs_transposed` `rhs[g]ᵀ` (`rhs[g]`
/// `[N, K]`, scales `[N/128, K/128]`). Every other row of `out` is zero.
#[allow(clippy::too_many_arguments)]
pub fn fp8_ragged_dot<O: Real>(
    shape: &GroupedShape,
    lhs: &[E4m3],
    lhs_scales: &[f32],
    rhs: &[E4m3],
    rhs_scales: &[f32],
    rhs_transposed: bool,
    group_sizes: &[i32],
    group_offset: i32,
    out: &mut [O],
) {
    let (k, n) = (shape.k, shape.n);
    let (k_blocks, n_blocks) = (k / FP8_BLOCK, n / FP8_BLOCK);
    out.fill(O::from_f32(0.0));
    if n == 0 || k == 0 {
        return;
    }
    for (g, (start, end)) in group_rows(group_sizes, group_offset, shape.local_groups, shape.m).into_iter().enumerate() {
        // The group's weights as f32 [K, N] (exact), and each column's scale per block of K: [K/128, N].
        let group = &rhs[g * k * n..(g + 1) * k * n];
        let w: Vec<f32> = if rhs_transposed {
            (0..k * n).map(|i| group[(i % n) * k + i / n].to_f32()).collect()
        } else {
            group.iter().map(|x| x.to_f32()).collect()
        };
        let scales = &rhs_scales[g * k_blocks * n_blocks..(g + 1) * k_blocks * n_blocks];
        let column_scales: Vec<f32> = (0..k_blocks * n)
            .map(|i| {
                let (b, column) = (i / n, i % n / FP8_BLOCK);
                if rhs_transposed { scales[column * k_blocks + b] } else { scales[b * n_blocks + column] }
            })
            .collect();
        out[start * n..end * n].par_chunks_mut(TILES_PER_TASK * TILE_ROWS * n).enumerate().for_each(|(task, rows)| {
            let mut panel: Panel = vec![[0f32; TILE_ROWS]; FP8_BLOCK];
            let mut partial = vec![0f32; TILE_ROWS * n];
            let mut acc = vec![0f32; TILE_ROWS * n];
            for (i, out_rows) in rows.chunks_mut(TILE_ROWS * n).enumerate() {
                let first = start + (task * TILES_PER_TASK + i) * TILE_ROWS;
                let count = out_rows.len() / n;
                acc.fill(0.0);
                for b in 0..k_blocks {
                    for (p, a) in panel.iter_mut().enumerate() {
                        for (t, a_t) in a.iter_mut().enumerate() {
                            *a_t = if t < count { lhs[(first + t) * k + b * FP8_BLOCK + p].to_f32() } else { 0.0 };
                        }
                    }
                    panel_product(&panel, &w[b * FP8_BLOCK * n..(b + 1) * FP8_BLOCK * n], n, &mut partial);
                    for t in 0..count {
                        let row_scale = lhs_scales[(first + t) * k_blocks + b];
                        for j in 0..n {
                            acc[t * n + j] += partial[t * n + j] * (row_scale * column_scales[b * n + j]);
                        }
                    }
                }
                for (o, &sum) in out_rows.iter_mut().zip(&acc) {
                    *o = O::from_f32(sum);
                }
            }
        });
    }
}

/// One chunk of an FP8 transposed product's rows, token-contiguous: `lhsᵀ [K,
/// rows]` with scales `[rows/128, K]`, `rhsᵀ [N, rows]` with scales `[rows/128,
/// N / rhs_block_columns]`.
pub struct Fp8ChunkRows<'s> {
    pub lhs: &'s [E4m3],
    pub lhs_scales: &'s [f32],
    pub rhs: &'s [E4m3],
    pub rhs_scales: &'s [f32],
    pub rows: usize,
}

/// `out[g][k, n] = Σ (partial[k, n] * (lhs_scales[b, k] * rhs_scales[b, n / c]))`
/// over each 128-row block `b` of each chunk, chunk after chunk and block after
/// block, where `partial` is the f32 sum (in increasing row order) of the FP8
/// products `lhsᵀ[k, r] rhsᵀ[n, r]` of the block's rows in local group `g`, and
/// `c = rhs_block_columns` (1, or 128 for rhs in 128 x 128 blocks); a group
/// with no rows gives zeros.
pub fn fp8_transposed_ragged_dot<O: Real>(
    shape: &GroupedShape,
    chunks: &[Fp8ChunkRows],
    rhs_block_columns: usize,
    group_sizes: &[i32],
    group_offset: i32,
    out: &mut [O],
) {
    let (k, n) = (shape.k, shape.n);
    if k * n == 0 {
        return;
    }
    let bounds = chunk_group_rows(shape, chunks.iter().map(|c| c.rows), group_sizes, group_offset);
    for (g, block) in out.chunks_mut(k * n).enumerate() {
        // The group's rows as (chunk, row block, first row, end), block by block.
        let mut segments = Vec::new();
        for (chunk, b) in chunks.iter().zip(&bounds) {
            let (start, end) = b[g];
            let mut row = start;
            while row < end {
                let block_end = ((row / FP8_BLOCK + 1) * FP8_BLOCK).min(end);
                segments.push((chunk, row / FP8_BLOCK, row, block_end));
                row = block_end;
            }
        }
        block.par_chunks_mut(TILES_PER_TASK * TILE_ROWS * n).enumerate().for_each(|(task, out_rows)| {
            let mut panel: Panel = Vec::with_capacity(FP8_BLOCK);
            let mut rhs_rows: Vec<f32> = Vec::with_capacity(FP8_BLOCK * n);
            let mut partial = vec![0f32; TILE_ROWS * n];
            let mut acc = vec![0f32; TILE_ROWS * n];
            for (i, tile_rows) in out_rows.chunks_mut(TILE_ROWS * n).enumerate() {
                // Output rows are rows of lhsᵀ: the tile's rows are lhsᵀ[first..first + count, r].
                let first = (task * TILES_PER_TASK + i) * TILE_ROWS;
                let count = tile_rows.len() / n;
                acc.fill(0.0);
                for &(c, b, start, end) in &segments {
                    panel.clear();
                    panel.extend((start..end).map(|r| {
                        std::array::from_fn(|t| if t < count { c.lhs[(first + t) * c.rows + r].to_f32() } else { 0.0 })
                    }));
                    rhs_rows.clear();
                    rhs_rows.extend((start..end).flat_map(|r| (0..n).map(move |j| c.rhs[j * c.rows + r].to_f32())));
                    panel_product(&panel, &rhs_rows, n, &mut partial);
                    let rhs_scales = &c.rhs_scales[b * (n / rhs_block_columns)..];
                    for t in 0..count {
                        let lhs_scale = c.lhs_scales[b * k + first + t];
                        for j in 0..n {
                            acc[t * n + j] += partial[t * n + j] * (lhs_scale * rhs_scales[j / rhs_block_columns]);
                        }
                    }
                }
                for (o, &sum) in tile_rows.iter_mut().zip(&acc) {
                    *o = O::from_f32(sum);
                }
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
        ragged_dot(&shape, &lhs, &rhs, false, &[1, 2], 0, true, &mut out);
        assert_eq!(out, [12., 4300., 6500., 0.]);

        let shape = GroupedShape { m: 4, k: 2, n: 1, groups: 2, local_groups: 2 };
        let mut grad = [9f32; 4];
        let chunk = ChunkRows { lhs: &lhs[..], rhs: &[1f32, 1., 2., 5.][..], rows: 4 };
        transposed_ragged_dot(&shape, &[chunk], &[1, 2], 0, &mut grad);
        assert_eq!(grad, [1., 2., 3. + 10., 4. + 12.]);
    }

    /// Groups [2, 1, 2, 3] over 10 rows, a window of groups 1 and 2 (rows
    /// 2..5): the rows before and after it are zero in every result with
    /// `zero_unused_rows`, and NaN without it (unspecified, made visible); the
    /// window's rows are the same either way.
    #[test]
    fn rows_outside_the_window_are_zeroed_or_nan() {
        const SENTINEL: f32 = -7.5;
        let shape = GroupedShape { m: 10, k: 2, n: 2, groups: 4, local_groups: 2 };
        let (sizes, window) = ([2, 1, 2, 3], 2..5);
        let lhs: Vec<f32> = (0..20).map(|i| i as f32).collect();
        let rhs = [1f32, 0., 0., 1., 2., 1., -1., 3.];
        // The product, the pre-activation and the (SwiGLU) hidden activation, each with its columns.
        let results = |zero_unused_rows| {
            let (mut out, mut pre, mut hidden) = (vec![SENTINEL; 20], vec![SENTINEL; 20], vec![SENTINEL; 10]);
            ragged_dot(&shape, &lhs, &rhs, false, &sizes, 1, zero_unused_rows, &mut out);
            ragged_dot_activation(&shape, &lhs, &rhs, Activation::Swiglu, &sizes, 1, zero_unused_rows, &mut pre,
                                  &mut hidden);
            [(out, 2), (pre, 2), (hidden, 1)]
        };
        let (zeroed, unspecified) = (results(true), results(false));
        // Row 2 (group 1) times the identity; rows 3 and 4 (group 2) times [[2, 1], [-1, 3]].
        assert_eq!(zeroed[0].0[4..10], [4., 5., 6. * 2. - 7., 6. + 7. * 3., 8. * 2. - 9., 8. + 9. * 3.]);
        assert_eq!(zeroed[1].0, zeroed[0].0);
        for ((zeroed, columns), (unspecified, _)) in zeroed.iter().zip(&unspecified) {
            for (row, (z, u)) in zeroed.chunks(*columns).zip(unspecified.chunks(*columns)).enumerate() {
                if window.contains(&row) {
                    assert!(z == u && z.iter().all(|&v| v != 0.0 && v != SENTINEL), "row {row}: {z:?}, {u:?}");
                } else {
                    assert!(z.iter().all(|&v| v == 0.0) && u.iter().all(|v| v.is_nan()), "row {row}: {z:?}, {u:?}");
                }
            }
        }
    }

    /// Two chunks of rows: each group's rows are its rows in chunk 0, then in
    /// chunk 1; a window of the last group.
    #[test]
    fn chunks_sum_each_groups_rows_chunk_after_chunk() {
        let (lhs0, rhs0) = ([1f32, 2., 3., 4., 5., 6.], [1f32, 10., 100.]);
        let (lhs1, rhs1) = ([7f32, 8., 9., 10.], [1000f32, 10000.]);
        let chunks = [ChunkRows { lhs: &lhs0[..], rhs: &rhs0[..], rows: 3 }, ChunkRows { lhs: &lhs1[..], rhs: &rhs1[..], rows: 2 }];
        // Chunk 0: group 0 row 0, group 1 rows 1..3; chunk 1: group 0 none, group 1 row 0 (row 1 in no group).
        let shape = GroupedShape { m: 5, k: 2, n: 1, groups: 2, local_groups: 2 };
        let mut out = [9f32; 4];
        transposed_ragged_dot(&shape, &chunks, &[1, 2, 0, 1], 0, &mut out);
        assert_eq!(out, [1., 2., 3. * 10. + 5. * 100. + 7000., 4. * 10. + 6. * 100. + 8000.]);
        let window = GroupedShape { local_groups: 1, ..shape };
        let mut last = [9f32; 2];
        transposed_ragged_dot(&window, &chunks, &[1, 2, 0, 1], 1, &mut last);
        assert_eq!(last, out[2..]);
    }

    /// E4m3 patterns of small integers: 1 = 0x38, 2 = 0x40, 3 = 0x44, 4 = 0x48.
    fn e4m3(values: &[f32]) -> Vec<E4m3> {
        values.iter().map(|&v| E4m3(match v as i32 { 0 => 0x00, 1 => 0x38, 2 => 0x40, 3 => 0x44, 4 => 0x48, -1 => 0xB8, _ => unreachable!() })).collect()
    }

    /// K = 256 (two blocks of the contraction), N = 128: each block's partial
    /// scaled by its own scales before the blocks are added.
    #[test]
    fn fp8_blocks_of_the_contraction_are_scaled_apart() {
        let (m, k, n) = (2, 256, 128);
        let shape = GroupedShape { m, k, n, groups: 1, local_groups: 1 };
        // Row 0: ones in block 0, twos in block 1; row 1 in no group.
        let lhs = e4m3(&(0..m * k).map(|i| if i >= k { 0.0 } else if i < 128 { 1.0 } else { 2.0 }).collect::<Vec<_>>());
        let lhs_scales = [0.5f32, 4.0, 9.0, 9.0];
        // Weights: 1 in block 0's rows, -1 in block 1's, over every column.
        let rhs = e4m3(&(0..k * n).map(|i| if i / n < 128 { 1.0 } else { -1.0 }).collect::<Vec<_>>());
        let rhs_scales = [3.0f32, 0.25];
        let mut out = [7f32; 2 * 128];
        fp8_ragged_dot(&shape, &lhs, &lhs_scales, &rhs, &rhs_scales, false, &[1], 0, &mut out);
        // Block 0: 128 * 1 * 1 * (0.5 * 3); block 1: 128 * 2 * -1 * (4 * 0.25).
        let expected = 128.0 * 1.5 - 256.0 * 1.0;
        assert!(out[..n].iter().all(|&v| v == expected) && out[n..].iter().all(|&v| v == 0.0), "{:?}", &out[..4]);
        // The same weights stored [G, N, K] and read transposed.
        let rhs_t: Vec<E4m3> = (0..k * n).map(|i| rhs[(i % k) * n + i / k]).collect();
        let mut out_t = [7f32; 2 * 128];
        fp8_ragged_dot(&shape, &lhs, &lhs_scales, &rhs_t, &rhs_scales, true, &[1], 0, &mut out_t);
        assert_eq!(out, out_t);
    }

    /// 256 rows in two chunks of 128; group 0 holds chunk 0's rows 0..100
    /// and chunk 1's rows 0..28, group 1 the rest: each 128-row block scaled
    /// by its own scales.
    #[test]
    fn fp8_transposed_blocks_of_rows_are_scaled_apart() {
        let (rows, k, n) = (128, 1, 2);
        let ones = e4m3(&vec![1.0; rows * k]);
        let twos = e4m3(&vec![2.0; rows * n]);
        let chunk = |lhs_scale: f32, rhs_scale: f32| (vec![lhs_scale; k], vec![rhs_scale; n]);
        let ((ls0, rs0), (ls1, rs1)) = (chunk(0.5, 1.0), chunk(2.0, 3.0));
        let chunks = [
            Fp8ChunkRows { lhs: &ones, lhs_scales: &ls0, rhs: &twos, rhs_scales: &rs0, rows },
            Fp8ChunkRows { lhs: &ones, lhs_scales: &ls1, rhs: &twos, rhs_scales: &rs1, rows },
        ];
        let shape = GroupedShape { m: 2 * rows, k, n, groups: 2, local_groups: 2 };
        let mut out = [7f32; 4];
        fp8_transposed_ragged_dot(&shape, &chunks, 1, &[100, 28, 28, 100], 0, &mut out);
        // Group 0: 100 rows of 1 * 2 * (0.5 * 1), then 28 of 1 * 2 * (2 * 3); group 1 the complements.
        let (g0, g1) = (100.0 * 2.0 * 0.5 + 28.0 * 2.0 * 6.0, 28.0 * 2.0 * 0.5 + 100.0 * 2.0 * 6.0);
        assert_eq!(out, [g0, g0, g1, g1]);
    }

    #[test]
    fn transposed_weights_match() {
        let shape = GroupedShape { m: 2, k: 3, n: 2, groups: 1, local_groups: 1 };
        let lhs = [1f32, 2., 3., -1., 0., 1.];
        let (w, w_t) = ([1f32, 2., 3., 4., 5., 6.], [1f32, 3., 5., 2., 4., 6.]);
        let (mut a, mut b) = ([0f32; 4], [0f32; 4]);
        ragged_dot(&shape, &lhs, &w, false, &[2], 0, true, &mut a);
        ragged_dot(&shape, &lhs, &w_t, true, &[2], 0, true, &mut b);
        assert_eq!(a, [22., 28., 4., 4.]);
        assert_eq!(a, b);
    }
}
