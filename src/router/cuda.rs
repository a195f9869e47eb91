//! CUDA implementations of the router primitives: which specialisation of
//! each kernel of `kernels/router.cu` a call needs (element type, experts,
//! top-k, groups and score function as template arguments) and its launch.

use super::{AuxLossBwd, AuxLossFwd, ScoreFunction, ScoresBwd, ScoresFwd, TopkBwd, TopkConfig, TopkFwd};
use crate::cuda::{arg, grid, int, launch, Instance, Kernel, LaunchConfig, Stream, ROUTER};
use crate::ffi::{DataType, Result};
use crate::invalid;

/// Threads per block of the per-token kernels (checked against the kernels'
/// `ROUTER_BLOCK`).
const ROUTER_BLOCK: u32 = 128;
/// Blocks of the loss's partial sums (its `PARTIALS`), and threads per block
/// of the loss's other kernels (their `BLOCK`).
const AUX_PARTIALS: u32 = 1024;
const AUX_BLOCK: u32 = 256;

/// Bytes of `oxmoe_aux_loss_fwd`'s workspace (its last result, see
/// [`crate::ffi::Call::workspace`]): the float32 partial sums of its blocks.
pub const AUX_LOSS_WORKSPACE_BYTES: usize = AUX_PARTIALS as usize * std::mem::size_of::<f32>();
/// A lane holds at most 64 experts of a row, so rows of up to 32 * 64.
pub const MAX_EXPERTS: usize = 2048;

/// Threads per token row (`Team::LANES` in the kernels): a warp, or one
/// thread for rows of fewer than 32 experts.
fn team_lanes(experts: usize) -> usize {
    if experts >= 32 {
        32
    } else {
        1
    }
}

/// `Score` in the kernels: 0 softmax (post), 1 softmax (pre), 2 sigmoid.
fn score_code(score_function: ScoreFunction, use_pre_softmax: bool) -> u8 {
    match (score_function, use_pre_softmax) {
        (ScoreFunction::Softmax, false) => 0,
        (ScoreFunction::Softmax, true) => 1,
        (ScoreFunction::Sigmoid, _) => 2,
    }
}

fn check_experts(experts: usize) -> Result<()> {
    if experts > MAX_EXPERTS {
        invalid!("{experts} experts: the CUDA router kernels hold a token's row in registers and take at most {MAX_EXPERTS}")
    }
    Ok(())
}

/// The `topk_fwd` instance a configuration needs.
pub fn topk_fwd_instance(config: &TopkConfig, dtype: DataType, has_bias: bool) -> Result<String> {
    let instance = Instance::new("topk_fwd")
        .dtype(dtype)
        .int(config.num_experts)
        .int(config.topk)
        .int(config.num_groups)
        .int(config.group_topk)
        .int(score_code(config.score_function, config.use_pre_softmax))
        .flag(has_bias);
    per_token_instance(instance, config.num_experts)
}

/// The `topk_bwd` instance a configuration needs.
pub fn topk_bwd_instance(config: &TopkConfig, dtype: DataType) -> Result<String> {
    let instance = Instance::new("topk_bwd")
        .dtype(dtype)
        .int(config.num_experts)
        .int(config.topk)
        .int(score_code(config.score_function, config.use_pre_softmax));
    per_token_instance(instance, config.num_experts)
}

/// The `scores_fwd` instance.
pub fn scores_fwd_instance(score_function: ScoreFunction, topk: usize, experts: usize, dtype: DataType) -> Result<String> {
    let instance = Instance::new("scores_fwd").dtype(dtype).int(experts).int(topk).int(score_code(score_function, false));
    per_token_instance(instance, experts)
}

/// The `scores_bwd` instance.
pub fn scores_bwd_instance(score_function: ScoreFunction, experts: usize, dtype: DataType) -> Result<String> {
    let instance = Instance::new("scores_bwd").dtype(dtype).int(experts).int(score_code(score_function, false));
    per_token_instance(instance, experts)
}

/// A per-token kernel's instance: its own arguments, then the launch
/// [`per_token`] makes (threads, token rows a block), which the kernel checks.
fn per_token_instance(instance: Instance, experts: usize) -> Result<String> {
    check_experts(experts)?;
    instance.int(ROUTER_BLOCK).int(rows_per_block(experts)).build()
}

/// The instances of the loss's forward partial sums and of its backward.
pub fn aux_loss_instances(experts: usize, probs: DataType, counts: DataType) -> Result<[String; 2]> {
    check_experts(experts)?;
    let partials = Instance::new("aux_loss_partials").dtype(probs).dtype(counts).int(experts).int(AUX_BLOCK).int(AUX_PARTIALS);
    let backward = Instance::new("aux_loss_bwd").dtype(probs).dtype(counts).int(experts).int(AUX_BLOCK);
    Ok([partials.build()?, backward.build()?])
}

/// The instance that adds the loss's partial sums.
pub fn aux_loss_total_instance() -> Result<String> {
    Instance::new("aux_loss_total").int(AUX_PARTIALS).build()
}

/// Token rows a per-token block handles (`Team::ROWS` in the kernels).
fn rows_per_block(experts: usize) -> usize {
    ROUTER_BLOCK as usize / team_lanes(experts)
}

/// One block per [`rows_per_block`] token rows.
fn per_token(tokens: usize, experts: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig { grid: grid(tokens.div_ceil(rows_per_block(experts)))?, block: ROUTER_BLOCK, shared_bytes: 0 })
}

pub fn topk_fwd(stream: Stream, a: &TopkFwd) -> Result<()> {
    let kernel = Kernel::get(stream, &ROUTER, &topk_fwd_instance(&a.config, a.logits.dtype(), a.bias.is_some())?)?;
    let (logits, probs, map) = (a.logits.device_ptr(), a.probs.device_ptr(), a.routing_map.device_ptr());
    let bias = a.bias.as_ref().map_or(0, |b| b.device_ptr());
    let (tokens, scaling) = (int(a.tokens)?, a.config.scaling_factor);
    let config = per_token(a.tokens, a.config.num_experts)?;
    launch(stream, kernel, config, &mut [arg(&logits), arg(&bias), arg(&probs), arg(&map), arg(&tokens), arg(&scaling)])
}

pub fn topk_bwd(stream: Stream, a: &TopkBwd) -> Result<()> {
    let kernel = Kernel::get(stream, &ROUTER, &topk_bwd_instance(&a.config, a.logits.dtype())?)?;
    let (grad, logits, map, out) =
        (a.grad_probs.device_ptr(), a.logits.device_ptr(), a.routing_map.device_ptr(), a.grad_logits.device_ptr());
    let (tokens, scaling) = (int(a.tokens)?, a.config.scaling_factor);
    let config = per_token(a.tokens, a.config.num_experts)?;
    launch(stream, kernel, config, &mut [arg(&grad), arg(&logits), arg(&map), arg(&out), arg(&tokens), arg(&scaling)])
}

pub fn scores_fwd(stream: Stream, a: &ScoresFwd) -> Result<()> {
    let instance = scores_fwd_instance(a.score_function, a.topk, a.experts, a.logits.dtype())?;
    let kernel = Kernel::get(stream, &ROUTER, &instance)?;
    let (logits, map, scores) = (a.logits.device_ptr(), a.routing_map.device_ptr(), a.scores.device_ptr());
    let tokens = int(a.tokens)?;
    launch(stream, kernel, per_token(a.tokens, a.experts)?, &mut [arg(&logits), arg(&map), arg(&scores), arg(&tokens)])
}

pub fn scores_bwd(stream: Stream, a: &ScoresBwd) -> Result<()> {
    let kernel = Kernel::get(stream, &ROUTER, &scores_bwd_instance(a.score_function, a.experts, a.logits.dtype())?)?;
    let (grad, logits, out) = (a.grad_scores.device_ptr(), a.logits.device_ptr(), a.grad_logits.device_ptr());
    let tokens = int(a.tokens)?;
    launch(stream, kernel, per_token(a.tokens, a.experts)?, &mut [arg(&grad), arg(&logits), arg(&out), arg(&tokens)])
}

pub fn aux_loss_fwd(stream: Stream, a: &AuxLossFwd) -> Result<()> {
    let [partials_instance, _] = aux_loss_instances(a.config.num_experts, a.probs.dtype(), a.counts.dtype())?;
    let partials_kernel = Kernel::get(stream, &ROUTER, &partials_instance)?;
    let total_kernel = Kernel::get(stream, &ROUTER, &aux_loss_total_instance()?)?;
    let (probs, counts, partials, loss) = (a.probs.device_ptr(), a.counts.device_ptr(), a.workspace.device_ptr(), a.loss.device_ptr());
    let (tokens, scale) = (int(a.tokens)?, a.config.scale());
    let blocks = LaunchConfig { grid: AUX_PARTIALS, block: AUX_BLOCK, shared_bytes: 0 };
    launch(stream, partials_kernel, blocks, &mut [arg(&probs), arg(&counts), arg(&partials), arg(&tokens)])?;
    let one_block = LaunchConfig { grid: 1, block: AUX_PARTIALS, shared_bytes: 0 };
    launch(stream, total_kernel, one_block, &mut [arg(&partials), arg(&loss), arg(&scale)])
}

pub fn aux_loss_bwd(stream: Stream, a: &AuxLossBwd) -> Result<()> {
    let [_, instance] = aux_loss_instances(a.config.num_experts, a.grad_probs.dtype(), a.counts.dtype())?;
    let kernel = Kernel::get(stream, &ROUTER, &instance)?;
    let (grad, counts, out) = (a.grad_loss.device_ptr(), a.counts.device_ptr(), a.grad_probs.device_ptr());
    let (tokens, scale) = (int(a.tokens)?, a.config.scale());
    // Enough blocks to fill any GPU; each thread loops over 16-byte vectors.
    let vectors = a.tokens * a.config.num_experts / 8 + 1;
    let blocks = grid(vectors.div_ceil(AUX_BLOCK as usize).min(1 << 16))?;
    launch(stream, kernel, LaunchConfig { grid: blocks, block: AUX_BLOCK, shared_bytes: 0 }, &mut [arg(&grad), arg(&counts), arg(&out), arg(&tokens), arg(&scale)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::assert_family_compiles;

    fn config(num_experts: usize, topk: usize, score_function: ScoreFunction, use_pre_softmax: bool, groups: (usize, usize)) -> TopkConfig {
        TopkConfig { num_experts, topk, score_function, use_pre_softmax, num_groups: groups.0, group_topk: groups.1, scaling_factor: 1.0 }
    }

    /// Every router kernel instance of the real-model shapes (and of shapes
    /// that take the kernels' other paths: rows that are not a multiple of 8,
    /// large expert counts), in each element type of `dtypes`.
    fn instances(dtypes: &[DataType]) -> Vec<String> {
        use ScoreFunction::{Sigmoid, Softmax};
        let configs = [
            config(8, 2, Softmax, false, (1, 1)),     // Mixtral
            config(128, 8, Softmax, false, (1, 1)),   // Qwen3-MoE
            config(128, 8, Softmax, true, (1, 1)),    // Qwen3-MoE, pre-softmax
            config(256, 8, Sigmoid, false, (8, 4)),   // DeepSeek-V3
            config(128, 1, Sigmoid, false, (1, 1)),   // Llama-4
            config(60, 4, Softmax, true, (4, 2)),     // scalar loads, groups of 15
            config(2048, 8, Sigmoid, false, (16, 4)), // the largest row
        ];
        let mut out = Vec::new();
        for &dtype in dtypes {
            for c in &configs {
                for has_bias in [false, true] {
                    if has_bias && c.score_function != Sigmoid {
                        continue;
                    }
                    out.push(topk_fwd_instance(c, dtype, has_bias).unwrap());
                }
                out.push(topk_bwd_instance(c, dtype).unwrap());
                out.push(scores_fwd_instance(c.score_function, c.topk, c.num_experts, dtype).unwrap());
                out.push(scores_bwd_instance(c.score_function, c.num_experts, dtype).unwrap());
            }
            for experts in [8, 60, 128, 256, 1024, 2048] {
                for counts in [DataType::S32, DataType::F32] {
                    out.extend(aux_loss_instances(experts, dtype, counts).unwrap());
                }
            }
        }
        out.push(aux_loss_total_instance().unwrap());
        out.sort();
        out.dedup();
        out
    }

    /// CI has no GPU but has NVRTC (the pip wheel, on LD_LIBRARY_PATH): a
    /// kernel that does not compile for any supported architecture fails here
    /// (`assert_family_compiles`).
    #[test]
    fn router_kernels_compile_for_ampere_hopper_and_blackwell() {
        assert_family_compiles(&ROUTER, instances);
    }

    #[test]
    fn too_many_experts_for_the_kernels_is_an_error() {
        let c = config(4096, 8, ScoreFunction::Softmax, false, (1, 1));
        let error = topk_fwd_instance(&c, DataType::F32, false).unwrap_err();
        assert!(error.message().contains("at most 2048"), "{}", error.message());
    }
}
