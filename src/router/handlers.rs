//! XLA FFI handlers of the router primitives (CPU platform).

use super::{cpu, AuxLossConfig, ScoreFunction, TopkConfig};
use crate::ffi::{Arg, Call, DataType, Result};
use crate::real::FLOAT_TYPES;
use crate::{export_handler, invalid, with_real_type};

export_handler!(oxmoe_topk_fwd, topk_fwd);
export_handler!(oxmoe_topk_bwd, topk_bwd);
export_handler!(oxmoe_aux_loss_scores_fwd, aux_loss_scores_fwd);
export_handler!(oxmoe_aux_loss_scores_bwd, aux_loss_scores_bwd);
export_handler!(oxmoe_aux_loss_fwd, aux_loss_fwd);
export_handler!(oxmoe_aux_loss_bwd, aux_loss_bwd);

/// A non-negative integer attribute.
fn count_attr(call: &Call, name: &str) -> Result<usize> {
    let value: i64 = call.attr(name)?;
    match usize::try_from(value) {
        Ok(count) => Ok(count),
        Err(_) => invalid!("attribute `{name}` is {value}, expected a non-negative integer"),
    }
}

/// The routing configuration from the call's attributes, validated.
/// The backward has no group attributes: its selection is given.
fn topk_config(call: &Call, num_experts: usize, grouped: bool) -> Result<TopkConfig> {
    let config = TopkConfig {
        num_experts,
        topk: count_attr(call, "topk")?,
        score_function: ScoreFunction::parse(call.attr("score_function")?)?,
        use_pre_softmax: call.attr("use_pre_softmax")?,
        num_groups: if grouped { count_attr(call, "num_groups")? } else { 1 },
        group_topk: if grouped { count_attr(call, "group_topk")? } else { 1 },
        scaling_factor: call.attr("scaling_factor")?,
    };
    config.validate()?;
    Ok(config)
}

/// `[T, E]` of the logits, which must be a float matrix.
fn logits_shape(logits: &Arg) -> Result<(usize, usize)> {
    logits.expect_dtype(&FLOAT_TYPES)?;
    logits.matrix()
}

fn topk_fwd(call: &Call) -> Result<()> {
    call.expect_num_args(1, 2)?;
    let logits = call.arg(0, "logits")?;
    let (tokens, experts) = logits_shape(&logits)?;
    let config = topk_config(call, experts, true)?;
    let bias = match call.optional_arg(1, "expert_bias")? {
        Some(bias) => {
            if config.score_function != ScoreFunction::Sigmoid {
                invalid!("expert_bias applies to score_function \"sigmoid\" only")
            }
            bias.expect_shape(&[experts])?;
            Some(bias.slice::<f32>()?)
        }
        None => None,
    };
    let probs = call.ret(0, "probs")?;
    probs.expect_shape(&[tokens, experts])?;
    let routing_map = call.ret(1, "routing_map")?;
    routing_map.expect_shape(&[tokens, experts])?;
    let routing_map = routing_map.mask_mut()?;
    with_real_type!(logits.dtype(), T => {
        cpu::topk_forward::<T>(&config, logits.slice()?, bias, probs.slice_mut()?, routing_map);
    });
    Ok(())
}

fn topk_bwd(call: &Call) -> Result<()> {
    call.expect_num_args(3, 3)?;
    let grad_probs = call.arg(0, "grad_probs")?;
    let logits = call.arg(1, "logits")?;
    let routing_map = call.arg(2, "routing_map")?;
    let (tokens, experts) = logits_shape(&logits)?;
    let config = topk_config(call, experts, false)?;
    grad_probs.expect_shape(&[tokens, experts])?;
    routing_map.expect_shape(&[tokens, experts])?;
    let grad_logits = call.ret(0, "grad_logits")?;
    grad_logits.expect_shape(&[tokens, experts])?;
    with_real_type!(logits.dtype(), T => {
        cpu::topk_backward::<T>(&config, grad_probs.slice()?, logits.slice()?, routing_map.mask()?, grad_logits.slice_mut()?);
    });
    Ok(())
}

fn aux_loss_scores_fwd(call: &Call) -> Result<()> {
    call.expect_num_args(1, 1)?;
    let logits = call.arg(0, "logits")?;
    let (tokens, experts) = logits_shape(&logits)?;
    let topk = count_attr(call, "topk")?;
    if topk < 1 || topk > experts {
        invalid!("topk is {topk}, expected 1 <= topk <= num_experts ({experts})")
    }
    let score_function = ScoreFunction::parse(call.attr("score_function")?)?;
    let routing_map = call.ret(0, "routing_map")?;
    routing_map.expect_shape(&[tokens, experts])?;
    let scores = call.ret(1, "scores")?;
    scores.expect_shape(&[tokens, experts])?;
    with_real_type!(logits.dtype(), T => {
        cpu::scores_forward::<T>(score_function, topk, experts, logits.slice()?, routing_map.mask_mut()?, scores.slice_mut()?);
    });
    Ok(())
}

fn aux_loss_scores_bwd(call: &Call) -> Result<()> {
    call.expect_num_args(2, 2)?;
    let grad_scores = call.arg(0, "grad_scores")?;
    let logits = call.arg(1, "logits")?;
    let (tokens, experts) = logits_shape(&logits)?;
    grad_scores.expect_shape(&[tokens, experts])?;
    let score_function = ScoreFunction::parse(call.attr("score_function")?)?;
    let grad_logits = call.ret(0, "grad_logits")?;
    grad_logits.expect_shape(&[tokens, experts])?;
    with_real_type!(logits.dtype(), T => {
        cpu::scores_backward::<T>(score_function, experts, grad_scores.slice()?, logits.slice()?, grad_logits.slice_mut()?);
    });
    Ok(())
}

fn aux_loss_config(call: &Call, num_experts: usize) -> Result<AuxLossConfig> {
    let config = AuxLossConfig {
        num_experts,
        topk: count_attr(call, "topk")?,
        total_num_tokens: count_attr(call, "total_num_tokens")?,
        coeff: call.attr("coeff")?,
    };
    config.validate()?;
    Ok(config)
}

/// `tokens_per_expert [E]` (int32 or float) as f32 counts.
fn tokens_per_expert(call: &Call, index: usize, num_experts: usize) -> Result<Vec<f32>> {
    let counts = call.arg(index, "tokens_per_expert")?;
    counts.expect_shape(&[num_experts])?;
    let dtype = counts.expect_dtype(&[DataType::S32, DataType::F32, DataType::BF16, DataType::F16])?;
    if dtype == DataType::S32 {
        return Ok(counts.slice::<i32>()?.iter().map(|&n| n as f32).collect());
    }
    with_real_type!(dtype, T => Ok(counts.slice::<T>()?.iter().map(|&n| crate::real::Real::to_f32(n)).collect()))
}

fn aux_loss_fwd(call: &Call) -> Result<()> {
    call.expect_num_args(2, 2)?;
    let probs = call.arg(0, "probs")?;
    probs.expect_dtype(&FLOAT_TYPES)?;
    let (_, experts) = probs.matrix()?;
    let config = aux_loss_config(call, experts)?;
    let counts = tokens_per_expert(call, 1, experts)?;
    let loss = call.ret(0, "loss")?;
    loss.expect_shape(&[])?;
    let value = with_real_type!(probs.dtype(), T => cpu::aux_loss_forward::<T>(&config, probs.slice()?, &counts));
    loss.slice_mut::<f32>()?[0] = value;
    Ok(())
}

fn aux_loss_bwd(call: &Call) -> Result<()> {
    call.expect_num_args(2, 2)?;
    let grad_loss = call.arg(0, "grad_loss")?;
    grad_loss.expect_shape(&[])?;
    let grad_loss = grad_loss.slice::<f32>()?[0];
    let grad_probs = call.ret(0, "grad_probs")?;
    grad_probs.expect_dtype(&FLOAT_TYPES)?;
    let (_, experts) = grad_probs.matrix()?;
    let config = aux_loss_config(call, experts)?;
    let counts = tokens_per_expert(call, 1, experts)?;
    with_real_type!(grad_probs.dtype(), T => cpu::aux_loss_backward::<T>(&config, grad_loss, &counts, grad_probs.slice_mut()?));
    Ok(())
}
