//! The router primitives' calls, decoded (and checked) once into typed
//! structs that the CPU and CUDA backends both take.

use super::{AuxLossConfig, ScoreFunction, TopkConfig};
use crate::ffi::{Arg, Call, DataType, Result, Ret};
use crate::invalid;
use crate::real::{float_matrix, FLOAT_TYPES};

/// The routing configuration from the call's attributes, validated.
/// The backward has no group attributes: its selection is given.
fn topk_config(call: &Call, num_experts: usize, grouped: bool) -> Result<TopkConfig> {
    let config = TopkConfig {
        num_experts,
        topk: call.count("topk")?,
        score_function: ScoreFunction::parse(call.attr("score_function")?)?,
        use_pre_softmax: call.attr("use_pre_softmax")?,
        num_groups: if grouped { call.count("num_groups")? } else { 1 },
        group_topk: if grouped { call.count("group_topk")? } else { 1 },
        scaling_factor: call.attr("scaling_factor")?,
    };
    config.validate()?;
    Ok(config)
}

/// `oxmoe_topk_fwd`: logits [T, E], optional expert_bias [E] f32 ->
/// probs [T, E] (logits' dtype), routing_map [T, E] bool.
pub struct TopkFwd<'a> {
    pub config: TopkConfig,
    pub tokens: usize,
    pub logits: Arg<'a>,
    pub bias: Option<Arg<'a>>,
    pub probs: Ret<'a>,
    pub routing_map: Ret<'a>,
}

impl<'a> TopkFwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(1, 2)?;
        let logits = call.arg(0, "logits")?;
        let (tokens, experts) = float_matrix(&logits)?;
        let config = topk_config(call, experts, true)?;
        let bias = call.optional_arg(1, "expert_bias")?;
        if let Some(bias) = &bias {
            if config.score_function != ScoreFunction::Sigmoid {
                invalid!("expert_bias applies to score_function \"sigmoid\" only")
            }
            bias.expect(&[DataType::F32], &[experts])?;
        }
        let probs = call.ret(0, "probs")?;
        probs.expect(&[logits.dtype()], &[tokens, experts])?;
        let routing_map = call.ret(1, "routing_map")?;
        routing_map.expect(&[DataType::PRED], &[tokens, experts])?;
        Ok(Self { config, tokens, logits, bias, probs, routing_map })
    }
}

/// `oxmoe_topk_bwd`: grad_probs, logits [T, E] (same float dtype),
/// routing_map [T, E] bool -> grad_logits [T, E].
pub struct TopkBwd<'a> {
    pub config: TopkConfig,
    pub tokens: usize,
    pub grad_probs: Arg<'a>,
    pub logits: Arg<'a>,
    pub routing_map: Arg<'a>,
    pub grad_logits: Ret<'a>,
}

impl<'a> TopkBwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(3, 3)?;
        let grad_probs = call.arg(0, "grad_probs")?;
        let logits = call.arg(1, "logits")?;
        let routing_map = call.arg(2, "routing_map")?;
        let (tokens, experts) = float_matrix(&logits)?;
        let config = topk_config(call, experts, false)?;
        grad_probs.expect(&[logits.dtype()], &[tokens, experts])?;
        routing_map.expect(&[DataType::PRED], &[tokens, experts])?;
        let grad_logits = call.ret(0, "grad_logits")?;
        grad_logits.expect(&[logits.dtype()], &[tokens, experts])?;
        Ok(Self { config, tokens, grad_probs, logits, routing_map, grad_logits })
    }
}

/// `oxmoe_aux_loss_scores_fwd`: logits [T, E] -> routing_map [T, E] bool, scores [T, E] f32.
pub struct ScoresFwd<'a> {
    pub score_function: ScoreFunction,
    pub topk: usize,
    pub tokens: usize,
    pub experts: usize,
    pub logits: Arg<'a>,
    pub routing_map: Ret<'a>,
    pub scores: Ret<'a>,
}

impl<'a> ScoresFwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(1, 1)?;
        let logits = call.arg(0, "logits")?;
        let (tokens, experts) = float_matrix(&logits)?;
        let topk = call.count("topk")?;
        if topk < 1 || topk > experts {
            invalid!("topk is {topk}, expected 1 <= topk <= num_experts ({experts})")
        }
        let score_function = ScoreFunction::parse(call.attr("score_function")?)?;
        let routing_map = call.ret(0, "routing_map")?;
        routing_map.expect(&[DataType::PRED], &[tokens, experts])?;
        let scores = call.ret(1, "scores")?;
        scores.expect(&[DataType::F32], &[tokens, experts])?;
        Ok(Self { score_function, topk, tokens, experts, logits, routing_map, scores })
    }
}

/// `oxmoe_aux_loss_scores_bwd`: grad_scores [T, E] f32, logits [T, E] -> grad_logits [T, E].
pub struct ScoresBwd<'a> {
    pub score_function: ScoreFunction,
    pub tokens: usize,
    pub experts: usize,
    pub grad_scores: Arg<'a>,
    pub logits: Arg<'a>,
    pub grad_logits: Ret<'a>,
}

impl<'a> ScoresBwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(2, 2)?;
        let grad_scores = call.arg(0, "grad_scores")?;
        let logits = call.arg(1, "logits")?;
        let (tokens, experts) = float_matrix(&logits)?;
        if experts == 0 {
            invalid!("logits has shape {:?}: no experts, expected at least 1", logits.dims())
        }
        grad_scores.expect(&[DataType::F32], &[tokens, experts])?;
        let score_function = ScoreFunction::parse(call.attr("score_function")?)?;
        let grad_logits = call.ret(0, "grad_logits")?;
        grad_logits.expect(&[logits.dtype()], &[tokens, experts])?;
        Ok(Self { score_function, tokens, experts, grad_scores, logits, grad_logits })
    }
}

fn aux_loss_config(call: &Call, num_experts: usize) -> Result<AuxLossConfig> {
    let config = AuxLossConfig {
        num_experts,
        topk: call.count("topk")?,
        total_num_tokens: call.count("total_num_tokens")?,
        coeff: call.attr("coeff")?,
    };
    config.validate()?;
    Ok(config)
}

/// The element types `tokens_per_expert` may have.
const COUNT_TYPES: [DataType; 4] = [DataType::S32, DataType::F32, DataType::BF16, DataType::F16];

/// `tokens_per_expert [E]`, int32 or float.
fn tokens_per_expert<'a>(call: &Call<'a>, index: usize, num_experts: usize) -> Result<Arg<'a>> {
    let counts = call.arg(index, "tokens_per_expert")?;
    counts.expect(&COUNT_TYPES, &[num_experts])?;
    Ok(counts)
}

/// `oxmoe_aux_loss_fwd`: probs [T, E], tokens_per_expert [E] -> loss [] f32
/// and the workspace (see [`super::cuda::AUX_LOSS_WORKSPACE_BYTES`]).
pub struct AuxLossFwd<'a> {
    pub config: AuxLossConfig,
    pub tokens: usize,
    pub probs: Arg<'a>,
    pub counts: Arg<'a>,
    pub loss: Ret<'a>,
    pub workspace: Ret<'a>,
}

impl<'a> AuxLossFwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(2, 2)?;
        let probs = call.arg(0, "probs")?;
        let (tokens, experts) = float_matrix(&probs)?;
        let config = aux_loss_config(call, experts)?;
        let counts = tokens_per_expert(call, 1, experts)?;
        let loss = call.ret(0, "loss")?;
        loss.expect(&[DataType::F32], &[])?;
        let workspace = call.workspace(1, super::cuda::AUX_LOSS_WORKSPACE_BYTES)?;
        Ok(Self { config, tokens, probs, counts, loss, workspace })
    }
}

/// `oxmoe_aux_loss_bwd`: grad_loss [] f32, tokens_per_expert [E] -> grad_probs [T, E].
pub struct AuxLossBwd<'a> {
    pub config: AuxLossConfig,
    pub tokens: usize,
    pub grad_loss: Arg<'a>,
    pub counts: Arg<'a>,
    pub grad_probs: Ret<'a>,
}

impl<'a> AuxLossBwd<'a> {
    pub(super) fn decode(call: &Call<'a>) -> Result<Self> {
        call.expect_num_args(2, 2)?;
        let grad_loss = call.arg(0, "grad_loss")?;
        grad_loss.expect(&[DataType::F32], &[])?;
        let grad_probs = call.ret(0, "grad_probs")?;
        grad_probs.expect_dtype(&FLOAT_TYPES)?;
        let (tokens, experts) = grad_probs.matrix()?;
        let config = aux_loss_config(call, experts)?;
        let counts = tokens_per_expert(call, 1, experts)?;
        Ok(Self { config, tokens, grad_loss, counts, grad_probs })
    }
}
