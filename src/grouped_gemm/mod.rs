//! Grouped GEMM: `ragged_dot` (rows of each group of a matrix times that
//! group's weight matrix), `ragged_dot_activation` (the same, and the expert
//! MLP's activation of it) and its transposed product (per group, the rows'
//! outer products summed: the weight gradient), in 16- and 32-bit floats and
//! on block-scaled FP8 operands (`fp8_*`: float8_e4m3fn values with one
//! float32 scale per block of 128 along each blocked dimension).
//!
//! Group sizes and the window's first group live in device memory and are
//! read by the kernels, never by the host. Out-of-range values are clamped
//! (see [`group_rows`]), so no size can make a kernel read or write out of
//! bounds. [`cpu`] is the executable specification, [`cuda`] runs
//! `kernels/grouped_gemm.cu` with the same semantics. Both take a call
//! decoded by `ops` ([`RaggedDot`], [`TransposedRaggedDot`]), which
//! [`handlers`] hands to one or the other.

pub mod cpu;
pub mod cuda;
pub mod handlers;
mod ops;

pub use ops::{Fp8RaggedDot, Fp8TransposedRaggedDot, RaggedDot, RaggedDotActivation, TransposedRaggedDot};

/// The static shape of a grouped product.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GroupedShape {
    /// Rows of the ragged operand(s).
    pub m: usize,
    /// `ragged_dot`: the contracted size; transposed product: the output's rows.
    pub k: usize,
    /// Output columns.
    pub n: usize,
    /// Groups in `group_sizes`.
    pub groups: usize,
    /// Groups of the weights (or of the transposed product's output): the
    /// window `group_offset .. group_offset + local_groups`.
    pub local_groups: usize,
}

/// The rows `[start, end)` of each local group: group `g` of `group_sizes`
/// starts where group `g - 1` ends. Negative sizes count as zero, every bound
/// is clamped to `m`, and the window's first group `offset` to `[0, groups]`;
/// local groups past the last group are empty.
pub fn group_rows(group_sizes: &[i32], offset: i32, local_groups: usize, m: usize) -> Vec<(usize, usize)> {
    let first = (offset.max(0) as usize).min(group_sizes.len());
    let mut start = 0usize;
    for &size in &group_sizes[..first] {
        start = (start + size.max(0) as usize).min(m);
    }
    (0..local_groups)
        .map(|i| {
            let size = group_sizes.get(first + i).map_or(0, |&s| s.max(0) as usize);
            let end = (start + size).min(m);
            let rows = (start, end);
            start = end;
            rows
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::group_rows;

    #[test]
    fn groups_follow_each_other_and_clamp() {
        assert_eq!(group_rows(&[2, 0, 3], 0, 3, 10), vec![(0, 2), (2, 2), (2, 5)]);
        // A window of the last two groups, and a local group past the end.
        assert_eq!(group_rows(&[2, 0, 3], 1, 3, 10), vec![(2, 2), (2, 5), (5, 5)]);
        // Negative sizes count as zero; the total is clamped to m.
        assert_eq!(group_rows(&[-4, 3, 9], 0, 3, 8), vec![(0, 0), (0, 3), (3, 8)]);
        // Offsets outside [0, groups] are clamped.
        assert_eq!(group_rows(&[1, 1], -3, 1, 4), vec![(0, 1)]);
        assert_eq!(group_rows(&[1, 1], 7, 1, 4), vec![(2, 2)]);
    }
}
