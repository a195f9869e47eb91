//! Block-scaled FP8 quantization (`oxmoe.fp8.quantize`,
//! `oxmoe.fp8.quantize_with_transpose` and `oxmoe.fp8.requantize`): `x
//! [batch, rows, columns]` to float8_e4m3fn values and one float32 scale per
//! block of the result, DeepSeek-V3's 1 x 128, 128 x 128 and 128 x 1 blocks;
//! the quantization of `x` as it is, of each batch element's transpose (read
//! from `x` as it is: the weight gradient's K-major operands), or both from
//! one read of `x`. `x` is a float array, or FP8 values and their 1 x 128
//! scales, dequantized as they are read (requantization).
//!
//! [`cpu`] is the executable specification, [`cuda`] runs
//! `kernels/quantize.cu` with the same semantics. Both take a call decoded
//! by `ops` ([`Quantize`]), which [`handlers`] hands to one or the other.

pub mod cpu;
pub mod cuda;
pub mod handlers;
mod ops;

pub use ops::{Input, Output, Quantize};

use crate::ffi::Result;
use crate::invalid;

/// The rows and columns of the result that one scale covers.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub rows: usize,
    pub cols: usize,
}

/// The FP8 recipe's block of activations: one scale per row per 128 columns.
pub const ACTIVATION_BLOCK: Block = Block { rows: 1, cols: 128 };

/// The blocks of the FP8 recipe: activations (1 x 128), weights (128 x 128),
/// and the weight gradient's activations (128 x 1).
pub const RECIPE_BLOCKS: [Block; 3] = [ACTIVATION_BLOCK, WEIGHT_BLOCK, Block { rows: 128, cols: 1 }];

/// The weights' blocks, 128 x 128.
pub const WEIGHT_BLOCK: Block = Block { rows: 128, cols: 128 };

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
}

impl Quantization {
    /// The result's rows and columns per batch element.
    pub fn result_matrix(&self) -> (usize, usize) {
        if self.transpose {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }

    /// The scales' rows and columns per batch element.
    pub fn scales_matrix(&self) -> (usize, usize) {
        let (rows, cols) = self.result_matrix();
        (rows / self.block.rows, cols / self.block.cols)
    }
}
