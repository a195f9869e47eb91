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
