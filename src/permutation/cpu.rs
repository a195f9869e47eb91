//! CPU implementations of the permutation primitives: the executable
//! specification. Token rows are `hidden` elements long; arithmetic is f32
//! (but for the merging weights' gradient, a dot product summed in f64).
//!
//! A dispatch is described by two maps: `dest_rows[t * E + e]`, the output
//! row of token `t`'s copy for expert `e` (-1: not routed, or dropped), and
//! `source_tokens[r]`, the token output row `r` holds (-1: a padding or unused
//! row, which is zero).

use super::{DispatchLayout, Entry};
use crate::real::{unused_row_value, Real};
use rayon::prelude::*;

/// Rows per parallel task: enough work to amortise scheduling.
const ROWS_PER_TASK: usize = 16;

/// The counts of a dispatch, one entry per expert.
pub struct ExpertCounts<'a> {
    /// Rows of each expert's block in the output (padded when aligning).
    pub tokens_per_expert: &'a mut [i32],
    /// Routed rows of each expert in the output.
    pub real_tokens_per_expert: &'a mut [i32],
    /// Padding rows before each expert's block.
    pub pad_offsets: &'a mut [i32],
}

/// Lays out a dispatch: expert-major, each expert's tokens in increasing
/// order, each expert's block padded with zero rows to a multiple of
/// `layout.align`. Copies whose row would be `layout.rows` or more are
/// dropped. Fills both maps, the counts, and (when given) the dispatched
/// routing weights `out_probs[row] = probs[t * E + e]`, zero elsewhere.
/// `pad_offsets[e]`, the padding rows before expert e's block, is at most
/// `i32::MAX` (only a block far past the output's rows could have more).
pub fn dispatch_map(
    layout: &DispatchLayout,
    routing_map: &[u8],
    probs: Option<(&[f32], &mut [f32])>,
    dest_rows: &mut [i32],
    source_tokens: &mut [i32],
    counts: ExpertCounts,
) {
    let (e, rows, align) = (layout.experts, layout.rows, layout.align);
    let mut routed = vec![0usize; e];
    for row in routing_map.chunks(e) {
        for (count, &bit) in routed.iter_mut().zip(row) {
            *count += usize::from(bit != 0);
        }
    }
    // Each expert's first row; a block may start past the end (dropped).
    // Offsets past `rows` all mean "dropped", so they saturate.
    let mut next_row = Vec::with_capacity(e);
    let (mut offset, mut unpadded_offset) = (0usize, 0usize);
    for (x, &count) in routed.iter().enumerate() {
        let padded = count.div_ceil(align).saturating_mul(align);
        next_row.push(offset);
        counts.tokens_per_expert[x] = rows.saturating_sub(offset).min(padded) as i32;
        counts.real_tokens_per_expert[x] = rows.saturating_sub(offset).min(count) as i32;
        counts.pad_offsets[x] = (offset - unpadded_offset).min(i32::MAX as usize) as i32;
        offset = offset.saturating_add(padded);
        unpadded_offset += count;
    }

    source_tokens.fill(-1);
    let mut probs = probs;
    if let Some((_, out)) = probs.as_mut() {
        out.fill(0.0);
    }
    for (t, (map_row, dest_row)) in routing_map.chunks(e).zip(dest_rows.chunks_mut(e)).enumerate() {
        for (x, (&bit, dest)) in map_row.iter().zip(dest_row.iter_mut()).enumerate() {
            *dest = -1;
            if bit == 0 {
                continue;
            }
            let row = next_row[x];
            next_row[x] = row.saturating_add(1);
            if row < rows {
                *dest = row as i32;
                source_tokens[row] = t as i32;
                if let Some((probs, out)) = probs.as_mut() {
                    out[row] = probs[t * e + x];
                }
            }
        }
    }
}

/// `out[r] = tokens[source_tokens[r]]`; where `source_tokens[r] < 0`, zeros
/// with `zero_unused_rows`, else unspecified ([`unused_row_value`]: NaN).
pub fn dispatch_rows<T: Real>(tokens: &[T], hidden: usize, source_tokens: &[i32], zero_unused_rows: bool, out: &mut [T]) {
    if hidden == 0 {
        return;
    }
    out.par_chunks_mut(hidden).zip(source_tokens.par_iter()).with_min_len(ROWS_PER_TASK).for_each(
        |(row, &t)| match usize::try_from(t) {
            Ok(t) => row.copy_from_slice(&tokens[t * hidden..(t + 1) * hidden]),
            Err(_) => row.fill(unused_row_value(zero_unused_rows)),
        },
    );
}


/// `out[t] = sum over e (in increasing order) of w[t, e] * expert_tokens[dest_rows[t, e]]`
/// for the routed `e`, with `w = 1` without `weights`, in f32 from `addend[t]`
/// (`[T, H]`) or from 0 without it; NaN if an entry is out of range.
pub fn combine<T: Real>(
    expert_tokens: &[T],
    hidden: usize,
    dest_rows: &[i32],
    experts: usize,
    weights: Option<&[f32]>,
    addend: Option<&[f32]>,
    out: &mut [T],
) {
    if hidden == 0 {
        return;
    }
    let rows = expert_tokens.len() / hidden;
    out.par_chunks_mut(hidden).enumerate().with_min_len(ROWS_PER_TASK).for_each_init(
        || vec![0f32; hidden],
        |sum, (t, out_row)| {
            match addend {
                Some(addend) => sum.copy_from_slice(&addend[t * hidden..(t + 1) * hidden]),
                None => sum.fill(0.0),
            }
            for x in 0..experts {
                let row = match Entry::of(dest_rows[t * experts + x], rows) {
                    Entry::None => continue,
                    Entry::At(row) => row,
                    Entry::Invalid => {
                        sum.fill(f32::NAN);
                        break;
                    }
                };
                let w = weights.map_or(1.0, |w| w[t * experts + x]);
                // Fused, as the GPU does it, so both round alike.
                for (s, &v) in sum.iter_mut().zip(&expert_tokens[row * hidden..(row + 1) * hidden]) {
                    *s = w.mul_add(v.to_f32(), *s);
                }
            }
            for (o, &s) in out_row.iter_mut().zip(sum.iter()) {
                *o = T::from_f32(s);
            }
        },
    );
}

/// The gradients of [`combine`]: with respect to the expert rows, and with
/// `weighted`, to the merging weights.
pub struct CombineGrads<'a, T> {
    pub grad_expert_tokens: &'a mut [T],
    /// `(weights, expert_tokens, grad_weights)`.
    pub weighted: Option<(&'a [f32], &'a [T], &'a mut [f32])>,
}

/// The backward of [`combine`]. Row `r` of the expert rows' gradient comes
/// from the token `t = source_tokens[r]` names: `s * grad_out[t]`, where `s`
/// sums the weights `w[t, e]` (1 without weights) of the experts `e` whose
/// `dest_rows[t, e]` is `r`, in increasing order; where `t` is -1, zero with
/// `zero_unused_rows` and unspecified without ([`unused_row_value`]); NaN where the maps disagree
/// (`t` out of range, or no `dest_rows[t, e]` is `r`), with or without.
/// Without weights a row of one copy is `grad_out[t]` bit for bit (NaN
/// payloads too), so that the gather moves any 32-bit words as they are.
/// For the maps of a dispatch this is the transpose of the forward. With
/// weights, `grad_weights[t, e] = <grad_out[t], expert_tokens[dest_rows[t, e]]>`
/// (summed in f64) for the routed `e`, 0 where `dest_rows[t, e]` is -1, NaN
/// where it is out of range.
pub fn combine_backward<T: Real>(
    grad_out: &[T],
    hidden: usize,
    dest_rows: &[i32],
    source_tokens: &[i32],
    experts: usize,
    zero_unused_rows: bool,
    grads: CombineGrads<T>,
) {
    let (tokens, rows) = (dest_rows.len() / experts, source_tokens.len());
    let CombineGrads { grad_expert_tokens, weighted } = grads;
    let weights = weighted.as_ref().map(|(w, _, _)| *w);
    if hidden > 0 {
        grad_expert_tokens.par_chunks_mut(hidden).zip(source_tokens.par_iter()).enumerate()
            .with_min_len(ROWS_PER_TASK).for_each(|(r, (out_row, &source))| {
                let t = match Entry::of(source, tokens) {
                    Entry::None => return out_row.fill(unused_row_value(zero_unused_rows)),
                    Entry::Invalid => return out_row.fill(T::from_f32(f32::NAN)),
                    Entry::At(t) => t,
                };
                let copies = (0..experts).filter(|&x| dest_rows[t * experts + x] == r as i32);
                let Some(scale) = copies.map(|x| weights.map_or(1.0, |w| w[t * experts + x])).reduce(|a, b| a + b) else {
                    return out_row.fill(T::from_f32(f32::NAN));
                };
                let grad_row = &grad_out[t * hidden..(t + 1) * hidden];
                if weights.is_none() && scale == 1.0 {
                    return out_row.copy_from_slice(grad_row);
                }
                for (o, &g) in out_row.iter_mut().zip(grad_row) {
                    *o = T::from_f32(scale * g.to_f32());
                }
            });
    }

    let Some((_, expert_tokens, grad_weights)) = weighted else { return };
    grad_weights.par_chunks_mut(experts).enumerate().with_min_len(ROWS_PER_TASK).for_each(|(t, grad_row)| {
        let g = &grad_out[t * hidden..(t + 1) * hidden];
        for (x, out) in grad_row.iter_mut().enumerate() {
            *out = match Entry::of(dest_rows[t * experts + x], rows) {
                Entry::None => 0.0,
                Entry::Invalid => f32::NAN,
                Entry::At(row) => {
                    // Exact products, summed in f64 and rounded once: the
                    // specification's error does not grow with `hidden`.
                    let y = &expert_tokens[row * hidden..(row + 1) * hidden];
                    // (Summed from +0.0: an empty row's gradient is +0.0, as on the GPU.)
                    g.iter().zip(y).fold(0.0f64, |sum, (&a, &b)| sum + f64::from(a.to_f32()) * f64::from(b.to_f32())) as f32
                }
            };
        }
    });
}

/// Where the chunks of a chunk sort lie: chunk `j` is `len[j]` rows at
/// `source_start[j]` in the unsorted layout and at `sorted_start[j]` in the
/// sorted one (`None`: `sorted_indices` does not list it).
pub struct ChunkLayout {
    pub len: Vec<usize>,
    pub source_start: Vec<usize>,
    pub sorted_start: Vec<Option<usize>>,
}

impl ChunkLayout {
    /// Chunk `j` has `max(split_sizes[j], 0)` rows, cut at `rows`; the sorted
    /// layout lists chunk `sorted_indices[p]` at position `p`, the first
    /// position that names it: indices out of range, and repeats, list
    /// nothing and take no rows, so the sort always moves each row at most
    /// once and its transpose is the inverse sort.
    pub fn new(split_sizes: &[i32], sorted_indices: &[i32], rows: usize) -> Self {
        let mut len = Vec::with_capacity(split_sizes.len());
        let mut source_start = Vec::with_capacity(split_sizes.len());
        let mut start = 0usize;
        for &size in split_sizes {
            let size = usize::try_from(size).unwrap_or(0);
            source_start.push(start);
            len.push(size.min(rows - start));
            start = (start + size).min(rows);
        }
        let mut sorted_start = vec![None; split_sizes.len()];
        let mut start = 0usize;
        for &j in sorted_indices {
            let Some(j) = usize::try_from(j).ok().filter(|&j| j < len.len()) else { continue };
            if sorted_start[j].is_none() {
                sorted_start[j] = Some(start);
                start += len[j];
            }
        }
        Self { len, source_start, sorted_start }
    }
}

/// Reorders chunks of rows: `inverse = false` moves chunk `sorted_indices[p]`
/// to position `p` (`sort_chunks`), `inverse = true` moves it back
/// (`unsort_chunks`). Rows no chunk fills are zero.
pub fn sort_chunks<T: Real>(
    tokens: &[T],
    hidden: usize,
    split_sizes: &[i32],
    sorted_indices: &[i32],
    inverse: bool,
    out: &mut [T],
) {
    if hidden == 0 {
        return;
    }
    let rows = tokens.len() / hidden;
    let layout = ChunkLayout::new(split_sizes, sorted_indices, rows);
    // source_row[r]: the input row that output row r copies.
    let mut source_row = vec![None; rows];
    for (j, sorted) in layout.sorted_start.iter().enumerate() {
        let Some(sorted) = *sorted else { continue };
        for i in 0..layout.len[j] {
            let (unsorted, sorted) = (layout.source_start[j] + i, sorted + i);
            let (to, from) = if inverse { (unsorted, sorted) } else { (sorted, unsorted) };
            source_row[to] = Some(from);
        }
    }
    out.par_chunks_mut(hidden).zip(source_row.par_iter()).with_min_len(ROWS_PER_TASK).for_each(
        |(row, source)| match source {
            Some(s) => row.copy_from_slice(&tokens[s * hidden..(s + 1) * hidden]),
            None => row.fill(T::from_f32(0.0)),
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(experts: usize, rows: usize, align: usize) -> DispatchLayout {
        DispatchLayout { tokens: 0, experts, rows, align }
    }

    #[test]
    fn dispatch_pads_blocks_and_drops_past_capacity() {
        // 3 tokens, 2 experts: expert 0 gets tokens 0, 2; expert 1 gets 0, 1, 2.
        let map = [1u8, 1, 0, 1, 1, 1];
        let (mut dest, mut source) = (vec![0; 6], vec![0; 8]);
        let (mut padded, mut real, mut pads) = (vec![0; 2], vec![0; 2], vec![0; 2]);
        let counts = ExpertCounts { tokens_per_expert: &mut padded, real_tokens_per_expert: &mut real, pad_offsets: &mut pads };
        dispatch_map(&layout(2, 8, 4), &map, None, &mut dest, &mut source, counts);
        assert_eq!(dest, [0, 4, -1, 5, 1, 6]);
        assert_eq!(source, [0, 2, -1, -1, 0, 1, 2, -1]);
        assert_eq!((padded, real, pads), (vec![4, 4], vec![2, 3], vec![0, 2]));

        // Capacity 5: expert 1's block starts at 4, only its first copy fits.
        let (mut dest, mut source) = (vec![0; 6], vec![0; 5]);
        let (mut padded, mut real, mut pads) = (vec![0; 2], vec![0; 2], vec![0; 2]);
        let counts = ExpertCounts { tokens_per_expert: &mut padded, real_tokens_per_expert: &mut real, pad_offsets: &mut pads };
        dispatch_map(&layout(2, 5, 4), &map, None, &mut dest, &mut source, counts);
        assert_eq!(dest, [0, 4, -1, -1, 1, -1]);
        assert_eq!((padded, real), (vec![4, 1], vec![2, 1]));
    }

    #[test]
    fn combine_weights_rows_and_marks_bad_maps() {
        let expert_tokens = [1.0f32, 2.0, 10.0, 20.0];
        let mut out = [0f32; 4];
        combine(&expert_tokens, 2, &[1, 0, -1, 1], 2, Some(&[0.5, 2.0, 9.0, 1.0]), None, &mut out);
        assert_eq!(out, [0.5 * 10.0 + 2.0 * 1.0, 0.5 * 20.0 + 2.0 * 2.0, 10.0, 20.0]);
        combine(&expert_tokens, 2, &[2, -1, -1, -1], 2, None, None, &mut out);
        assert!(out[..2].iter().all(|x| x.is_nan()) && out[2..] == [0.0, 0.0]);
        // An addend starts each sum; a token of no copies is its row, -0 kept; a bad map is NaN still.
        combine(&expert_tokens, 2, &[1, 0, -1, -1], 2, None, Some(&[0.25, -0.5, -0.0, 3.0]), &mut out);
        assert_eq!(out.map(f32::to_bits), [0.25 + 10.0 + 1.0, -0.5 + 20.0 + 2.0, -0.0, 3.0].map(f32::to_bits));
        combine(&expert_tokens, 2, &[7, -1, -1, -1], 2, None, Some(&[1.0; 4]), &mut out);
        assert!(out[..2].iter().all(|x| x.is_nan()) && out[2..] == [1.0, 1.0]);
    }

    #[test]
    fn combine_backward_writes_every_output_whatever_the_maps() {
        // 2 tokens, 2 experts, 4 rows of 1 element. Row 0: token 0's copy for
        // expert 1; row 1: padding; row 2 names token 5 (out of range); row 3
        // names token 1, whose dest_rows do not list it; token 1 lists row 9.
        let (dest_rows, source_tokens) = ([-1, 0, 9, -1], [0, -1, 5, 1]);
        let (grad_out, weights, expert_tokens) = ([2.0f32, 3.0], [0.0f32, 0.5, 0.25, 0.0], [4.0f32, 1.0, 1.0, 1.0]);
        let (mut grad_rows, mut grad_weights) = ([f32::INFINITY; 4], [f32::INFINITY; 4]);
        let grads = CombineGrads { grad_expert_tokens: &mut grad_rows, weighted: Some((&weights, &expert_tokens, &mut grad_weights)) };
        combine_backward(&grad_out, 1, &dest_rows, &source_tokens, 2, true, grads);
        assert_eq!(grad_rows[..2], [0.5 * 2.0, 0.0]);
        assert!(grad_rows[2].is_nan() && grad_rows[3].is_nan());
        assert_eq!(grad_weights[..2], [0.0, 2.0 * 4.0]);
        assert!(grad_weights[2].is_nan() && grad_weights[3] == 0.0);

        // Rows of no elements: the weights' gradient is still written (zeros).
        let mut grad_weights = [f32::NAN; 4];
        let grads = CombineGrads { grad_expert_tokens: &mut [], weighted: Some((&weights, &[], &mut grad_weights)) };
        combine_backward::<f32>(&[], 0, &[-1, 0, 1, -1], &[0, 1], 2, true, grads);
        assert_eq!(grad_weights, [0.0; 4]);

        // A token listing one row for two experts: their weights summed.
        let mut grad_rows = [f32::NAN; 1];
        let grads = CombineGrads { grad_expert_tokens: &mut grad_rows, weighted: None };
        combine_backward(&[3.0f32], 1, &[0, 0], &[0], 2, true, grads);
        assert_eq!(grad_rows, [6.0]);
    }

    /// What an output held before the call: every row is written over.
    const SENTINEL: f32 = -123.25;

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn dispatch_rows_zero_the_unused_rows_or_make_them_nan() {
        // 3 rows of 2 elements: token 1's, padding, token 0's.
        let (tokens, source_tokens) = ([1.0f32, 2.0, 3.0, 4.0], [1, -1, 0]);
        for (zero_unused_rows, unused) in [(true, 0.0), (false, f32::NAN)] {
            let mut out = [SENTINEL; 6];
            dispatch_rows(&tokens, 2, &source_tokens, zero_unused_rows, &mut out);
            assert_eq!(bits(&out), bits(&[3.0, 4.0, unused, unused, 1.0, 2.0]), "zero_unused_rows {zero_unused_rows}");
        }
    }

    #[test]
    fn combine_backward_zeroes_unused_rows_or_makes_them_nan_and_marks_bad_maps_either_way() {
        // 2 tokens, 2 experts, 5 rows of 2 elements. Row 0: token 1's copy for
        // expert 0; row 1: padding; row 2: token 0's copy for expert 1; row 3
        // names token 0, which does not list it; row 4 names token 7 (out of range).
        let (dest_rows, source_tokens) = ([-1, 2, 0, -1], [1, -1, 0, 0, 7]);
        let grad_out = [1.0f32, 2.0, 3.0, 4.0];
        for (zero_unused_rows, unused) in [(true, 0.0), (false, f32::NAN)] {
            let mut grad_rows = [SENTINEL; 10];
            let grads = CombineGrads { grad_expert_tokens: &mut grad_rows, weighted: None };
            combine_backward(&grad_out, 2, &dest_rows, &source_tokens, 2, zero_unused_rows, grads);
            let context = format!("zero_unused_rows {zero_unused_rows}: {grad_rows:?}");
            assert_eq!(bits(&grad_rows[..6]), bits(&[3.0, 4.0, unused, unused, 1.0, 2.0]), "{context}");
            assert!(grad_rows[6..].iter().all(|x| x.is_nan()), "{context}");
        }
    }

    #[test]
    fn merging_weights_gradient_is_the_dot_product_rounded_once() {
        // 2^24 + 1 + 1 + ...: a left-to-right f32 sum loses every 1.
        let hidden = 1 << 12;
        let mut g = vec![1.0f32; hidden];
        g[0] = (1u32 << 24) as f32;
        let mut grad_weights = [0.0f32];
        let grads = CombineGrads { grad_expert_tokens: &mut vec![0.0; hidden], weighted: Some((&[1.0], &vec![1.0f32; hidden], &mut grad_weights)) };
        combine_backward(&g, hidden, &[0], &[0], 1, true, grads);
        assert_eq!(grad_weights[0], ((1u64 << 24) + hidden as u64 - 1) as f32);
    }

    #[test]
    fn dispatch_offsets_saturate_instead_of_wrapping() {
        // align 2^62: expert 0's block takes all rows, expert 1's starts
        // past the end, after more padding than an int32 counts.
        let map = [1u8, 1, 1, 1];
        let (mut dest, mut source) = (vec![0; 4], vec![0; 4]);
        let (mut padded, mut real, mut pads) = (vec![0; 2], vec![0; 2], vec![0; 2]);
        let counts = ExpertCounts { tokens_per_expert: &mut padded, real_tokens_per_expert: &mut real, pad_offsets: &mut pads };
        dispatch_map(&layout(2, 4, 1 << 62), &map, None, &mut dest, &mut source, counts);
        assert_eq!(dest, [0, -1, 1, -1]);
        assert_eq!(source, [0, 1, -1, -1]);
        assert_eq!((padded, real, pads), (vec![4, 0], vec![2, 0], vec![0, i32::MAX]));
    }

    #[test]
    fn a_repeated_or_out_of_range_index_lists_nothing() {
        let tokens: Vec<f32> = (1..=5).map(|x| x as f32).collect();
        let (sizes, order) = ([2, 3], [1, 1]);
        let mut sorted = vec![0f32; 5];
        sort_chunks(&tokens, 1, &sizes, &order, false, &mut sorted);
        assert_eq!(sorted, [3.0, 4.0, 5.0, 0.0, 0.0]);
        let mut back = vec![f32::NAN; 5];
        sort_chunks(&sorted, 1, &sizes, &order, true, &mut back);
        assert_eq!(back, [0.0, 0.0, 3.0, 4.0, 5.0]);
        sort_chunks(&tokens, 1, &sizes, &[7, 0], false, &mut sorted);
        assert_eq!(sorted, [1.0, 2.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn unsort_inverts_sort() {
        let tokens: Vec<f32> = (0..7).map(|x| x as f32).collect();
        let (sizes, order) = ([2, 0, 3, 1], [2, 0, 3, 1]);
        let mut sorted = vec![0f32; 7];
        sort_chunks(&tokens, 1, &sizes, &order, false, &mut sorted);
        assert_eq!(sorted, [2.0, 3.0, 4.0, 0.0, 1.0, 5.0, 0.0]);
        let mut back = vec![0f32; 7];
        sort_chunks(&sorted, 1, &sizes, &order, true, &mut back);
        assert_eq!(back, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0]);
    }
}
