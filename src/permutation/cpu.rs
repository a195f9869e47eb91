//! CPU implementations of the permutation primitives: the executable
//! specification. Token rows are `hidden` elements long; arithmetic is f32.
//!
//! A dispatch is described by two maps: `dest_rows[t * E + e]`, the output
//! row of token `t`'s copy for expert `e` (-1: not routed, or dropped), and
//! `source_tokens[r]`, the token output row `r` holds (-1: a padding or unused
//! row, which is zero).

use super::DispatchLayout;
use crate::real::Real;
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
    let mut next_row = Vec::with_capacity(e);
    let (mut offset, mut unpadded_offset) = (0usize, 0usize);
    for (x, &count) in routed.iter().enumerate() {
        let padded = count.div_ceil(align) * align;
        next_row.push(offset);
        counts.tokens_per_expert[x] = rows.saturating_sub(offset).min(padded) as i32;
        counts.real_tokens_per_expert[x] = rows.saturating_sub(offset).min(count) as i32;
        counts.pad_offsets[x] = (offset - unpadded_offset) as i32;
        offset += padded;
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
            next_row[x] += 1;
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

/// `out[r] = tokens[source_tokens[r]]`, or zeros where `source_tokens[r] < 0`.
pub fn dispatch_rows<T: Real>(tokens: &[T], hidden: usize, source_tokens: &[i32], out: &mut [T]) {
    if hidden == 0 {
        return;
    }
    out.par_chunks_mut(hidden).zip(source_tokens.par_iter()).with_min_len(ROWS_PER_TASK).for_each(
        |(row, &t)| match usize::try_from(t) {
            Ok(t) => row.copy_from_slice(&tokens[t * hidden..(t + 1) * hidden]),
            Err(_) => row.fill(T::from_f32(0.0)),
        },
    );
}

/// Where a `dest_rows` entry points: nowhere (-1), a row of the `rows`
/// expert rows, or out of range (a map that does not belong to them).
enum Dest {
    None,
    Row(usize),
    Invalid,
}

fn dest(entry: i32, rows: usize) -> Dest {
    match entry {
        -1 => Dest::None,
        r if r >= 0 && (r as usize) < rows => Dest::Row(r as usize),
        _ => Dest::Invalid,
    }
}

/// `out[t] = sum over e (in increasing order) of w[t, e] * expert_tokens[dest_rows[t, e]]`
/// for the routed `e`, with `w = 1` without `weights`; NaN if an entry is out of range.
pub fn combine<T: Real>(
    expert_tokens: &[T],
    hidden: usize,
    dest_rows: &[i32],
    experts: usize,
    weights: Option<&[f32]>,
    out: &mut [T],
) {
    if hidden == 0 {
        return;
    }
    let rows = expert_tokens.len() / hidden;
    out.par_chunks_mut(hidden).enumerate().with_min_len(ROWS_PER_TASK).for_each_init(
        || vec![0f32; hidden],
        |sum, (t, out_row)| {
            sum.fill(0.0);
            for x in 0..experts {
                let row = match dest(dest_rows[t * experts + x], rows) {
                    Dest::None => continue,
                    Dest::Row(row) => row,
                    Dest::Invalid => {
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

/// The backward of [`combine`]: `grad_expert_tokens[dest_rows[t, e]] = w[t, e] *
/// grad_out[t]` (zero on rows no copy refers to), and with `weights`, the
/// merging weights' gradient `grad_weights[t, e] = <grad_out[t],
/// expert_tokens[dest_rows[t, e]]>` for the routed `e` (NaN when out of range).
pub struct CombineGrads<'a, T> {
    pub grad_expert_tokens: &'a mut [T],
    /// `(weights, expert_tokens, grad_weights)`.
    pub weighted: Option<(&'a [f32], &'a [T], &'a mut [f32])>,
}

pub fn combine_backward<T: Real>(
    grad_out: &[T],
    hidden: usize,
    dest_rows: &[i32],
    source_tokens: &[i32],
    experts: usize,
    grads: CombineGrads<T>,
) {
    if hidden == 0 {
        return;
    }
    let rows = source_tokens.len();
    let CombineGrads { grad_expert_tokens, weighted } = grads;
    let weights = weighted.as_ref().map(|(w, _, _)| *w);
    grad_expert_tokens.par_chunks_mut(hidden).zip(source_tokens.par_iter()).enumerate()
        .with_min_len(ROWS_PER_TASK).for_each(|(r, (out_row, &t))| {
            // The copy of token t this row holds (a dispatch's maps agree).
            let copy = usize::try_from(t).ok().and_then(|t| {
                (0..experts).find(|&x| dest_rows[t * experts + x] == r as i32).map(|x| (t, x))
            });
            match copy {
                Some((t, x)) => {
                    let w = weights.map_or(1.0, |w| w[t * experts + x]);
                    for (o, &g) in out_row.iter_mut().zip(&grad_out[t * hidden..(t + 1) * hidden]) {
                        *o = T::from_f32(w * g.to_f32());
                    }
                }
                None => out_row.fill(T::from_f32(0.0)),
            }
        });

    let Some((_, expert_tokens, grad_weights)) = weighted else { return };
    grad_weights.par_chunks_mut(experts).enumerate().with_min_len(ROWS_PER_TASK).for_each(|(t, grad_row)| {
        let g = &grad_out[t * hidden..(t + 1) * hidden];
        for (x, out) in grad_row.iter_mut().enumerate() {
            *out = match dest(dest_rows[t * experts + x], rows) {
                Dest::None => 0.0,
                Dest::Invalid => f32::NAN,
                Dest::Row(row) => {
                    let y = &expert_tokens[row * hidden..(row + 1) * hidden];
                    g.iter().zip(y).map(|(&a, &b)| a.to_f32() * b.to_f32()).sum()
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
    /// layout lists chunk `sorted_indices[p]` at position `p`, skipping
    /// indices out of range (a chunk listed twice keeps its first position).
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
            sorted_start[j].get_or_insert(start);
            start += len[j];
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
    if inverse {
        for (j, sorted) in layout.sorted_start.iter().enumerate() {
            let Some(sorted) = *sorted else { continue };
            for i in 0..layout.len[j].min(rows.saturating_sub(sorted)) {
                source_row[layout.source_start[j] + i] = Some(sorted + i);
            }
        }
    } else {
        let mut start = 0usize;
        for j in sorted_indices.iter().filter_map(|&j| usize::try_from(j).ok()).filter(|&j| j < layout.len.len()) {
            for i in 0..layout.len[j].min(rows.saturating_sub(start)) {
                source_row[start + i] = Some(layout.source_start[j] + i);
            }
            start += layout.len[j];
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
        combine(&expert_tokens, 2, &[1, 0, -1, 1], 2, Some(&[0.5, 2.0, 9.0, 1.0]), &mut out);
        assert_eq!(out, [0.5 * 10.0 + 2.0 * 1.0, 0.5 * 20.0 + 2.0 * 2.0, 10.0, 20.0]);
        combine(&expert_tokens, 2, &[2, -1, -1, -1], 2, None, &mut out);
        assert!(out[..2].iter().all(|x| x.is_nan()) && out[2..] == [0.0, 0.0]);
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
