//! Block-scaled FP8 quantization (`oxmoe.fp8.quantize`,
//! `oxmoe.fp8.quantize_with_transpose` and `oxmoe.fp8.requantize`): `x
//! [batch, rows, columns]` to float8_e4m3fn values and one float32 scale per
//! block of the result, DeepSeek-V3's 1 x 128, 128 x 128 and 128 x 1 blocks;
//! the quantization of `x` as it is, of each batch element's transpose (read
//! from `x` as it is: the weight gradient's K-major operands), or both from
//! one read of `x`. `x` is a float array, or FP8 values and their 1 x 128
//! scales, dequantized as they are read (requantization). With group sizes,
//! the transpose's 128 x 1 blocks restart at each group's first row
//! ([`group_aligned_rows`]): the FP8 weight gradient's operands, whose blocks
//! then never hold two experts' rows.
//!
//! [`cpu`] is the executable specification, [`cuda`] runs
//! `kernels/quantize.cu` with the same semantics. Both take a call decoded
//! by `ops` ([`Quantize`]), which [`handlers`] hands to one or the other.

pub mod cpu;
pub mod cuda;
pub mod handlers;
mod ops;

pub use ops::{GroupAligned, Input, Output, Quantize};

use crate::ffi::Result;
use crate::invalid;

/// The rows and columns of the result that one scale covers.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub rows: usize,
    pub cols: usize,
}

/// The blocks of the FP8 recipe: activations (1 x 128), weights (128 x 128),
/// and the weight gradient's activations (128 x 1).
pub const RECIPE_BLOCKS: [Block; 3] =
    [Block { rows: 1, cols: 128 }, Block { rows: 128, cols: 128 }, Block { rows: 128, cols: 1 }];

/// Which quantizations of `x` a call writes (attribute `orientation`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Orientation {
    /// `x`'s: values `[batch, rows, cols]` (`"as_is"`).
    AsIs,
    /// Each batch element's transpose's: values `[batch, cols, rows]` (`"transposed"`).
    Transposed,
    /// Both, `x`'s then its transpose's, from one read of `x` (`"both"`).
    Both,
}

impl Orientation {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "as_is" => Ok(Self::AsIs),
            "transposed" => Ok(Self::Transposed),
            "both" => Ok(Self::Both),
            other => invalid!("orientation is {other:?}, expected \"as_is\", \"transposed\" or \"both\""),
        }
    }

    /// Whether the call writes `x`'s quantization as it is.
    pub fn as_is(self) -> bool {
        self != Self::Transposed
    }

    /// Whether the call writes the quantization of `x`'s transpose.
    pub fn transposed(self) -> bool {
        self != Self::AsIs
    }
}

/// One quantization's static shape and options.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Quantization {
    /// `x`'s dimensions: `[batch, rows, cols]`.
    pub batch: usize,
    pub rows: usize,
    pub cols: usize,
    /// The block, in the result's rows and columns.
    pub block: Block,
    /// Each scale rounded up to a power of two.
    pub power_of_two_scales: bool,
    /// The result is each batch element's transpose, quantized: `[batch, cols, rows]`.
    pub transpose: bool,
    /// With `Some(groups)` (a transpose of one matrix in 1 x 128 blocks), x's
    /// rows come in `groups` groups and the result holds them group-aligned:
    /// `[cols, group_aligned_rows(rows, groups)]`.
    pub groups: Option<usize>,
}

/// The columns of a group-aligned transpose of `rows` rows in `groups` groups:
/// each group's rows start at a multiple of 128 columns, and so do the rows
/// after the last group (one more group), zeros between them and after. At
/// most 127 columns of zeros follow each of the `groups + 1`, so their total,
/// a multiple of 128, is at most this.
pub fn group_aligned_rows(rows: usize, groups: usize) -> usize {
    (rows + 127 * (groups + 1)) / 128 * 128
}

/// The rows `[start, end)` of each of a group-aligned transpose's `groups + 1`
/// groups (`group_sizes`' clamped to `rows` as the grouped products clamp
/// them, then the rows after the last), and the column where each starts.
pub fn group_aligned_starts(group_sizes: &[i32], rows: usize) -> Vec<((usize, usize), usize)> {
    let mut groups = crate::grouped_gemm::group_rows(group_sizes, 0, group_sizes.len(), rows);
    groups.push((groups.last().map_or(0, |g| g.1), rows));
    let mut column = 0;
    groups
        .into_iter()
        .map(|(start, end)| {
            let at = column;
            column += (end - start).div_ceil(128) * 128;
            ((start, end), at)
        })
        .collect()
}

impl Quantization {
    /// The result's rows and columns per batch element.
    pub fn result_matrix(&self) -> (usize, usize) {
        match (self.transpose, self.groups) {
            (true, Some(groups)) => (self.cols, group_aligned_rows(self.rows, groups)),
            (true, None) => (self.cols, self.rows),
            (false, _) => (self.rows, self.cols),
        }
    }

    /// The scales' rows and columns per batch element.
    pub fn scales_matrix(&self) -> (usize, usize) {
        let (rows, cols) = self.result_matrix();
        (rows / self.block.rows, cols / self.block.cols)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Groups of 130, 0 and 5 rows of 200, then the 65 after them: each from a
    /// multiple of 128 columns, the empty one where the next starts.
    #[test]
    fn aligned_groups_start_at_multiples_of_128() {
        let starts = group_aligned_starts(&[130, 0, 5], 200);
        assert_eq!(starts, vec![((0, 130), 0), ((130, 130), 256), ((130, 135), 256), ((135, 200), 384)]);
        assert!(group_aligned_rows(200, 3) >= 512);
        // Sizes past the rows are clamped as the products clamp them; negative ones are empty.
        assert_eq!(group_aligned_starts(&[-4, 300], 200), vec![((0, 0), 0), ((0, 200), 0), ((200, 200), 256)]);
    }

    /// The bound holds with every group one row past a multiple of 128.
    #[test]
    fn the_aligned_columns_bound_every_grouping() {
        for (sizes, rows) in [(vec![129; 7], 7 * 129 + 1), (vec![1; 40], 41), (vec![], 5), (vec![128, 128], 256)] {
            let starts = group_aligned_starts(&sizes, rows);
            let ((start, end), at) = *starts.last().unwrap();
            assert!(at + (end - start).div_ceil(128) * 128 <= group_aligned_rows(rows, sizes.len()), "{sizes:?}");
        }
    }
}
