//! The experts' activation over the rows of a grouped GEMM: SiLU or GELU (tanh
//! approximation), alone or gating a linear half (SwiGLU, GeGLU), in f32, on the
//! rows the groups cover. Past them (a buffer sized for the worst case of an
//! expert-parallel exchange is about half padding) nothing is read and zeros are
//! written, which is what the activation of the grouped GEMM's zero rows gives.
//!
//! [`cpu`] is the executable specification, [`cuda`] runs `kernels/activation.cu`
//! with the same semantics. Both take a call decoded by `ops`.

pub mod cpu;
pub mod cuda;
pub mod handlers;
mod ops;

pub use ops::{ActivationBwd, ActivationFwd};

/// Which activation: `gelu` (tanh approximation) or SiLU, and whether it gates
/// a linear half (`glu`: the input's first half is the gate, its second the
/// linear part).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Activation {
    pub glu: bool,
    pub gelu: bool,
}

/// The rows the groups cover: the sum of the sizes (negative ones as zero), at
/// most `rows` (as the grouped GEMMs bound their groups).
pub fn covered_rows(group_sizes: &[i32], rows: usize) -> usize {
    group_sizes.iter().fold(0usize, |total, &size| total.saturating_add(size.max(0) as usize)).min(rows)
}
