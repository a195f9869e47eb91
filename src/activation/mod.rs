//! The expert MLP's activation backward (`oxmoe.activation.activation_bwd`),
//! in one pass over each dispatched row: from the gradient of the row's
//! hidden activation before its routing weight, the up projection's output
//! before the activation and the row's weight, the up projection's gradient,
//! the hidden activation times the weight (the down weight gradient's
//! operand) and the weight's gradient. What three passes of XLA fusions
//! computed, each reading the up projection's output again. Its FP8 form
//! (`oxmoe.fp8.activation_bwd`) gives the two 16-bit results quantized as the
//! FP8 layer's backward products take them, from the same pass; the
//! forward's (`oxmoe.fp8.activation`), the hidden activation quantized as the
//! down projection takes it.
//!
//! [`cpu`] is the executable specification, [`cuda`] runs
//! `kernels/activation.cu` with the same semantics. Both take a call decoded
//! by `ops` ([`ActivationBwd`]), which [`handlers`] hands to one or the other.

pub mod cpu;
pub mod cuda;
pub mod handlers;
mod ops;

pub use ops::{ActivationBwd, ActivationBwdFp8, ActivationFp8, ActivationOperands};

use crate::ffi::Result;
use crate::invalid;

/// The expert MLP's activation (attribute `activation`): gated ones take the
/// up projection's output as `[gate, up]` (`2F` columns) and give
/// `act(gate) * up`, the others give `act(x)` of `F` columns.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up` (`"swiglu"`).
    Swiglu,
    /// `gelu(gate) * up`, GELU's tanh approximation (`"geglu"`).
    Geglu,
    /// `gelu(x)`, the tanh approximation (`"gelu"`).
    Gelu,
    /// `silu(x)` (`"silu"`).
    Silu,
}

impl Activation {
    pub const ALL: [Self; 4] = [Self::Swiglu, Self::Geglu, Self::Gelu, Self::Silu];

    pub fn parse(name: &str) -> Result<Self> {
        match Self::ALL.into_iter().find(|activation| activation.name() == name) {
            Some(activation) => Ok(activation),
            None => invalid!("activation is {name:?}, expected \"swiglu\", \"geglu\", \"gelu\" or \"silu\""),
        }
    }

    /// Its name, as `parse` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Swiglu => "swiglu",
            Self::Geglu => "geglu",
            Self::Gelu => "gelu",
            Self::Silu => "silu",
        }
    }

    /// Whether the up projection's output is `[gate, up]`.
    pub fn gated(self) -> bool {
        matches!(self, Self::Swiglu | Self::Geglu)
    }

    /// Whether the nonlinearity is GELU's tanh approximation (else SiLU).
    pub fn gelu(self) -> bool {
        matches!(self, Self::Geglu | Self::Gelu)
    }

    /// The activation as the kernels take it, a template argument
    /// (`kernels/common.cuh`'s `SWIGLU` ... `SILU`; 0 there is no activation).
    pub fn code(self) -> i32 {
        match self {
            Self::Swiglu => 1,
            Self::Geglu => 2,
            Self::Gelu => 3,
            Self::Silu => 4,
        }
    }

    /// The hidden activation's columns of an up projection's output of
    /// `input_columns`: half of them when gated (`input_columns`' inverse).
    pub fn hidden_columns(self, input_columns: usize) -> usize {
        if self.gated() {
            input_columns / 2
        } else {
            input_columns
        }
    }

    /// The up projection's output columns per hidden column: 2 when gated.
    pub fn input_columns(self, features: usize) -> usize {
        if self.gated() {
            2 * features
        } else {
            features
        }
    }
}
