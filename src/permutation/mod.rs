//! Permutation primitives: dispatch (token rows to expert-major order, with
//! alignment padding), combine (back to token order, weighted and summed),
//! and chunk sorting (the local reorder after an all-to-all).
//!
//! [`cpu`] is the executable specification, [`cuda`] runs
//! `kernels/permutation.cu` with the same semantics. Both take a call
//! decoded by `ops` ([`DispatchFwd`], ...), which [`handlers`] hands to one
//! or the other.

pub mod cpu;
pub mod cuda;
pub mod handlers;
mod ops;

pub use ops::{CombineBwd, CombineFwd, DispatchFwd, SortChunks};

/// Where an entry of a row map points (a `dest_rows` entry into the expert
/// rows, a `source_tokens` entry into the tokens or, for
/// `oxmoe.fp8.requantize`, into its FP8 rows): nowhere (-1), an index below
/// `len`, or out of range (a map that does not belong to them). The gathers
/// give a row of nowhere zeros and one out of range NaNs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    None,
    At(usize),
    Invalid,
}

impl Entry {
    pub fn of(value: i32, len: usize) -> Self {
        match value {
            -1 => Self::None,
            i if i >= 0 && (i as usize) < len => Self::At(i as usize),
            _ => Self::Invalid,
        }
    }
}

/// The static shape of a dispatch.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DispatchLayout {
    pub tokens: usize,
    pub experts: usize,
    /// Output rows: routed copies past this many rows are dropped.
    pub rows: usize,
    /// Each expert's block is padded to a multiple of this (1: no padding).
    pub align: usize,
}
