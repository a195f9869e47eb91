//! Router primitives: top-k expert selection with its backward, the dense
//! scores of the load-balancing loss, and the loss itself.
//!
//! [`cpu`] is the executable specification (the semantics are documented on
//! each function there), [`cuda`] runs `kernels/router.cu` with the same
//! semantics. Both take a call decoded by `ops` ([`TopkFwd`], ...), which
//! [`handlers`] hands to one or the other.

pub mod cpu;
pub mod cuda;
pub mod handlers;
mod ops;

pub use ops::{AuxLossBwd, AuxLossFwd, ScoresBwd, ScoresFwd, TopkBwd, TopkFwd};

use crate::ffi::Result;
use crate::invalid;

/// How router logits become scores.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ScoreFunction {
    Softmax,
    Sigmoid,
}

impl ScoreFunction {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "softmax" => Ok(Self::Softmax),
            "sigmoid" => Ok(Self::Sigmoid),
            other => invalid!("score_function is {other:?}, expected \"softmax\" or \"sigmoid\""),
        }
    }
}

/// The static configuration of a top-k routing.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct TopkConfig {
    pub num_experts: usize,
    pub topk: usize,
    pub score_function: ScoreFunction,
    /// Softmax over all experts before selecting (softmax only).
    pub use_pre_softmax: bool,
    /// Experts form `num_groups` consecutive groups; 1 means no group limit.
    pub num_groups: usize,
    /// Only experts of the best `group_topk` groups can be selected.
    pub group_topk: usize,
    pub scaling_factor: f32,
}

impl TopkConfig {
    /// Checks the configuration is one the semantics define.
    pub fn validate(&self) -> Result<()> {
        let e = self.num_experts;
        if self.topk < 1 || self.topk > e {
            invalid!("topk is {}, expected 1 <= topk <= num_experts ({e})", self.topk)
        }
        if self.use_pre_softmax && self.score_function != ScoreFunction::Softmax {
            invalid!("use_pre_softmax applies to score_function \"softmax\" only")
        }
        if self.num_groups < 1 || !e.is_multiple_of(self.num_groups) {
            invalid!("num_groups is {}, expected a divisor of num_experts ({e})", self.num_groups)
        }
        if self.group_topk < 1 || self.group_topk > self.num_groups || self.group_topk > self.topk {
            invalid!(
                "group_topk is {}, expected 1 <= group_topk <= min(num_groups ({}), topk ({}))",
                self.group_topk,
                self.num_groups,
                self.topk
            )
        }
        if self.topk > self.group_topk * (e / self.num_groups) {
            invalid!(
                "topk is {}, more than the {} experts in the best group_topk ({}) groups",
                self.topk,
                self.group_topk * (e / self.num_groups),
                self.group_topk
            )
        }
        Ok(())
    }

    fn is_grouped(&self) -> bool {
        self.num_groups > 1
    }
}

/// The switch load-balancing loss: `coeff * E / (topk * N^2) * sum_e P_e * f_e`.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct AuxLossConfig {
    pub num_experts: usize,
    pub topk: usize,
    pub total_num_tokens: usize,
    pub coeff: f32,
}

impl AuxLossConfig {
    pub fn validate(&self) -> Result<()> {
        if self.topk < 1 || self.topk > self.num_experts {
            invalid!("topk is {}, expected 1 <= topk <= num_experts ({})", self.topk, self.num_experts)
        }
        if self.total_num_tokens < 1 {
            invalid!("total_num_tokens is {}, expected at least 1", self.total_num_tokens)
        }
        Ok(())
    }

    /// The factor that multiplies `sum_t probs[t, e] * tokens_per_expert[e]`.
    pub fn scale(&self) -> f32 {
        let n = self.total_num_tokens as f64;
        (f64::from(self.coeff) * self.num_experts as f64 / (self.topk as f64 * n * n)) as f32
    }
}
