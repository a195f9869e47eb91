//! CPU implementations of the router primitives: the executable specification.
//!
//! All arithmetic is f32 whatever the element type. Rows (tokens) are
//! independent and processed in parallel; every function is deterministic.
//! Selection everywhere ranks by value, ties to the lower index, NaN lowest.

use super::{AuxLossConfig, ScoreFunction, TopkConfig};
use crate::real::Real;
use rayon::prelude::*;

/// Rows per parallel task: enough work to amortise scheduling.
const ROWS_PER_TASK: usize = 64;

/// Appends to `out` (cleared first) the indices `i` of the `k` largest
/// `keys[i]` with `allowed(i)`, best first. Ties go to the lower index and NaN
/// ranks below every number, so the result is always well defined.
pub fn top_k_indices(keys: &[f32], k: usize, allowed: impl Fn(usize) -> bool, out: &mut Vec<usize>) {
    let rank = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
    out.clear();
    if k == 0 {
        return;
    }
    // The key to beat once `out` is full; indices arrive in increasing order,
    // so an equal key never moves ahead.
    let mut threshold = f32::NEG_INFINITY;
    for (i, &key) in keys.iter().enumerate() {
        let loses = out.len() == k && key.partial_cmp(&threshold) != Some(std::cmp::Ordering::Greater);
        if loses || !allowed(i) {
            continue;
        }
        let key = rank(key);
        if out.len() == k {
            out.pop();
        }
        let position = out.iter().position(|&j| key > rank(keys[j])).unwrap_or(out.len());
        out.insert(position, i);
        if out.len() == k {
            threshold = rank(keys[out[k - 1]]);
        }
    }
}

/// Copies `row` into `out` as f32.
fn widen<T: Real>(row: &[T], out: &mut [f32]) {
    for (o, &x) in out.iter_mut().zip(row) {
        *o = x.to_f32();
    }
}

fn softmax_into(row: &[f32], out: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for (o, &x) in out.iter_mut().zip(row) {
        *o = (x - max).exp();
        sum += *o;
    }
    for o in out.iter_mut() {
        *o /= sum;
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// sigmoid(x) e^-c, for sigmoids normalised over a set (topk's selection, or a
/// row for the loss's scores) with c = min(0, the set's largest logit): the
/// factor cancels in the normalisation, and the largest term stays at least 1/2,
/// so the sum cannot underflow to 0 (below about -88 every sigmoid is 0) and
/// leave the weights 0 / 0. A term underflows only where its share is below
/// f32's smallest normal number. With c = 0 it is `sigmoid(x)`, bit for bit.
/// `kernels/router.cu` and `oxmoe.reference.router` compute the same.
fn shifted_sigmoid(x: f32, c: f32) -> f32 {
    1.0 / (c.exp() + (c - x).exp())
}

/// The shift c of `shifted_sigmoid` for a set of logits.
fn sigmoid_shift(logits: impl Iterator<Item = f32>) -> f32 {
    logits.fold(f32::NEG_INFINITY, f32::max).min(0.0)
}

/// Per-thread working memory for one row.
struct Scratch {
    logits: Vec<f32>,
    scores: Vec<f32>,
    keys: Vec<f32>,
    group_keys: Vec<f32>,
    chosen: Vec<usize>,
    chosen_groups: Vec<usize>,
    allowed_groups: Vec<bool>,
    weights: Vec<f32>,
}

impl Scratch {
    fn new(config: &TopkConfig) -> Self {
        let e = config.num_experts;
        Self {
            logits: vec![0.0; e],
            scores: vec![0.0; e],
            keys: vec![0.0; e],
            group_keys: vec![0.0; config.num_groups],
            chosen: Vec::with_capacity(e),
            chosen_groups: Vec::with_capacity(config.num_groups),
            allowed_groups: vec![true; config.num_groups],
            weights: Vec::with_capacity(config.topk),
        }
    }

    fn load<T: Real>(&mut self, row: &[T]) {
        widen(row, &mut self.logits);
    }

    /// Scores (pre-softmax or sigmoid) and selection keys of the loaded row.
    fn score(&mut self, config: &TopkConfig, bias: Option<&[f32]>) {
        match config.score_function {
            // Post-softmax needs no scores: it selects on the logits and weights
            // by a softmax over the selected ones.
            ScoreFunction::Softmax if !config.use_pre_softmax => self.keys.copy_from_slice(&self.logits),
            ScoreFunction::Softmax => {
                softmax_into(&self.logits, &mut self.scores);
                self.keys.copy_from_slice(&self.scores);
            }
            ScoreFunction::Sigmoid => {
                for ((s, k), (i, &l)) in self.scores.iter_mut().zip(&mut self.keys).zip(self.logits.iter().enumerate()) {
                    *s = sigmoid(l);
                    *k = *s + bias.map_or(0.0, |b| b[i]);
                }
            }
        }
    }

    /// Selects the experts of the loaded, scored row into `self.chosen`.
    fn select(&mut self, config: &TopkConfig) {
        if !config.is_grouped() {
            top_k_indices(&self.keys, config.topk, |_| true, &mut self.chosen);
            return;
        }
        let group_size = config.num_experts / config.num_groups;
        let per_group = config.topk / config.group_topk;
        for (g, group_key) in self.group_keys.iter_mut().enumerate() {
            let members = &self.keys[g * group_size..(g + 1) * group_size];
            top_k_indices(members, per_group, |_| true, &mut self.chosen);
            *group_key = self.chosen.iter().map(|&i| members[i]).sum();
        }
        top_k_indices(&self.group_keys, config.group_topk, |_| true, &mut self.chosen_groups);
        self.allowed_groups.fill(false);
        for &g in &self.chosen_groups {
            self.allowed_groups[g] = true;
        }
        let allowed = &self.allowed_groups;
        top_k_indices(&self.keys, config.topk, |i| allowed[i / group_size], &mut self.chosen);
    }
}

/// Top-k routing, forward.
///
/// Per token (row of `logits [T, E]`): scores s and selection keys by the
/// score function (softmax pre: keys = s = softmax(logits); softmax post:
/// keys = logits; sigmoid: s = sigmoid(logits), keys = s + bias), optionally
/// limited to the experts of the best `group_topk` groups (a group ranks by the
/// sum of its best `topk / group_topk` keys), then the `topk` best keys are
/// selected. Weights: s (pre-softmax), softmax over the selected logits
/// (post-softmax), or s normalised to sum 1 over the selection (sigmoid with
/// topk > 1, computed as `shifted_sigmoid` says), times `scaling_factor`.
/// `probs` is zero off the selection and `routing_map` is 1 on it.
pub fn topk_forward<T: Real>(config: &TopkConfig, logits: &[T], bias: Option<&[f32]>, probs: &mut [T], routing_map: &mut [u8]) {
    let e = config.num_experts;
    logits
        .par_chunks(e)
        .zip(probs.par_chunks_mut(e))
        .zip(routing_map.par_chunks_mut(e))
        .with_min_len(ROWS_PER_TASK)
        .for_each_init(
            || Scratch::new(config),
            |scratch, ((row, probs_row), map_row)| {
                scratch.load(row);
                scratch.score(config, bias);
                scratch.select(config);
                let Scratch { chosen, weights, logits, scores, .. } = scratch;
                weights.clear();
                match config.score_function {
                    ScoreFunction::Softmax if !config.use_pre_softmax => {
                        weights.extend(chosen.iter().map(|&i| logits[i]));
                        let max = weights.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        weights.iter_mut().for_each(|w| *w = (*w - max).exp());
                        let sum: f32 = weights.iter().sum();
                        weights.iter_mut().for_each(|w| *w /= sum);
                    }
                    _ => {
                        if config.score_function == ScoreFunction::Sigmoid && config.topk > 1 {
                            let c = sigmoid_shift(chosen.iter().map(|&i| logits[i]));
                            weights.extend(chosen.iter().map(|&i| shifted_sigmoid(logits[i], c)));
                            let sum: f32 = weights.iter().sum();
                            weights.iter_mut().for_each(|w| *w /= sum);
                        } else {
                            weights.extend(chosen.iter().map(|&i| scores[i]));
                        }
                    }
                }
                probs_row.fill(T::from_f32(0.0));
                map_row.fill(0);
                for (&i, &w) in chosen.iter().zip(weights.iter()) {
                    probs_row[i] = T::from_f32(w * config.scaling_factor);
                    map_row[i] = 1;
                }
            },
        );
}

/// Top-k routing, backward: d logits from d probs with the selection
/// (`routing_map`) held fixed. The scores are recomputed from `logits`.
pub fn topk_backward<T: Real>(config: &TopkConfig, grad_probs: &[T], logits: &[T], routing_map: &[u8], grad_logits: &mut [T]) {
    let e = config.num_experts;
    let scale = config.scaling_factor;
    grad_probs
        .par_chunks(e)
        .zip(logits.par_chunks(e))
        .zip(routing_map.par_chunks(e))
        .zip(grad_logits.par_chunks_mut(e))
        .with_min_len(ROWS_PER_TASK)
        .for_each_init(
            || (vec![0.0f32; e], vec![0.0f32; e]),
            |(x, s), (((g_row, l_row), map_row), out)| {
                let g = |i: usize| scale * g_row[i].to_f32();
                let selected = |i: usize| map_row[i] != 0;
                widen(l_row, x);
                match config.score_function {
                    ScoreFunction::Softmax if config.use_pre_softmax => {
                        // probs_i = scale * s_i on the selection, s = softmax(x).
                        softmax_into(x, s);
                        let dot: f32 = (0..e).filter(|&i| selected(i)).map(|i| g(i) * s[i]).sum();
                        for i in 0..e {
                            let gi = if selected(i) { g(i) } else { 0.0 };
                            out[i] = T::from_f32(s[i] * (gi - dot));
                        }
                    }
                    ScoreFunction::Softmax => {
                        // probs = scale * softmax over the selected logits.
                        let max = (0..e).filter(|&i| selected(i)).map(|i| x[i]).fold(f32::NEG_INFINITY, f32::max);
                        let mut sum = 0.0f32;
                        for i in 0..e {
                            s[i] = if selected(i) { (x[i] - max).exp() } else { 0.0 };
                            sum += s[i];
                        }
                        let dot: f32 = (0..e).filter(|&i| selected(i)).map(|i| g(i) * s[i] / sum).sum();
                        for i in 0..e {
                            let value = if selected(i) { s[i] / sum * (g(i) - dot) } else { 0.0 };
                            out[i] = T::from_f32(value);
                        }
                    }
                    ScoreFunction::Sigmoid => {
                        // probs_i = scale * s_i / S (S = sum of selected s) when topk > 1, else
                        // scale * s_i; s times e^-c where topk > 1 (see `shifted_sigmoid`).
                        let c = if config.topk > 1 { sigmoid_shift((0..e).filter(|&i| selected(i)).map(|i| x[i])) } else { 0.0 };
                        for i in 0..e {
                            s[i] = shifted_sigmoid(x[i], c);
                        }
                        let (sum, dot) = if config.topk > 1 {
                            let sum: f32 = (0..e).filter(|&i| selected(i)).map(|i| s[i]).sum();
                            (sum, (0..e).filter(|&i| selected(i)).map(|i| g(i) * s[i] / sum).sum())
                        } else {
                            (1.0, 0.0)
                        };
                        for i in 0..e {
                            // sigmoid' = s * (1 - s), with 1 - s as sigmoid(-x): no cancellation near s = 1.
                            let value = if selected(i) { (g(i) - dot) / sum * s[i] * sigmoid(-x[i]) } else { 0.0 };
                            out[i] = T::from_f32(value);
                        }
                    }
                }
            },
        );
}

/// Scores of the load-balancing loss, forward: `scores [T, E]` is
/// softmax(logits), or sigmoid(logits) normalised to sum 1 per token (as
/// `shifted_sigmoid` says); `routing_map` marks the plain top-k of the scores.
pub fn scores_forward<T: Real>(score_function: ScoreFunction, topk: usize, num_experts: usize, logits: &[T], routing_map: &mut [u8], scores: &mut [f32]) {
    let e = num_experts;
    logits
        .par_chunks(e)
        .zip(scores.par_chunks_mut(e))
        .zip(routing_map.par_chunks_mut(e))
        .with_min_len(ROWS_PER_TASK)
        .for_each_init(
            || (vec![0.0f32; e], Vec::with_capacity(topk)),
            |(x, chosen), ((row, scores_row), map_row)| {
                widen(row, x);
                normalised_scores(score_function, x, scores_row);
                top_k_indices(scores_row, topk, |_| true, chosen);
                map_row.fill(0);
                for &i in chosen.iter() {
                    map_row[i] = 1;
                }
            },
        );
}

/// softmax(x), or sigmoid(x) normalised to sum 1.
fn normalised_scores(score_function: ScoreFunction, x: &[f32], out: &mut [f32]) {
    match score_function {
        ScoreFunction::Softmax => softmax_into(x, out),
        ScoreFunction::Sigmoid => {
            let c = sigmoid_shift(x.iter().copied());
            for (o, &xi) in out.iter_mut().zip(x) {
                *o = shifted_sigmoid(xi, c);
            }
            let sum: f32 = out.iter().sum();
            out.iter_mut().for_each(|o| *o /= sum);
        }
    }
}

/// Scores of the load-balancing loss, backward: d logits from d scores.
pub fn scores_backward<T: Real>(score_function: ScoreFunction, num_experts: usize, grad_scores: &[f32], logits: &[T], grad_logits: &mut [T]) {
    let e = num_experts;
    grad_scores
        .par_chunks(e)
        .zip(logits.par_chunks(e))
        .zip(grad_logits.par_chunks_mut(e))
        .with_min_len(ROWS_PER_TASK)
        .for_each_init(
            || (vec![0.0f32; e], vec![0.0f32; e]),
            |(x, q), ((g, row), out)| {
                widen(row, x);
                normalised_scores(score_function, x, q);
                // Both are q = u / sum(u); d u_i = (g_i - <g, q>) / sum(u) * u_i'.
                let dot: f32 = g.iter().zip(q.iter()).map(|(gi, qi)| gi * qi).sum();
                for i in 0..e {
                    let value = match score_function {
                        // u = exp(x): u_i' / sum(u) = q_i.
                        ScoreFunction::Softmax => q[i] * (g[i] - dot),
                        // u = sigmoid(x): u_i' / sum(u) = q_i * (1 - sigmoid(x_i)) = q_i * sigmoid(-x_i).
                        ScoreFunction::Sigmoid => q[i] * sigmoid(-x[i]) * (g[i] - dot),
                    };
                    out[i] = T::from_f32(value);
                }
            },
        );
}

/// Rows per block of the column sums; blocks are summed in order, so the loss
/// is the same whatever the number of threads.
const AUX_LOSS_ROWS_PER_BLOCK: usize = 1024;

/// The load-balancing loss, forward:
/// `scale * sum_e (sum_t probs[t, e]) * tokens_per_expert[e]` with
/// `scale = coeff * E / (topk * total_num_tokens^2)`.
pub fn aux_loss_forward<T: Real>(config: &AuxLossConfig, probs: &[T], tokens_per_expert: &[f32]) -> f32 {
    let e = config.num_experts;
    let partial_sums: Vec<Vec<f32>> = probs
        .par_chunks(e * AUX_LOSS_ROWS_PER_BLOCK)
        .map(|block| {
            let mut sums = vec![0.0f32; e];
            for row in block.chunks(e) {
                for (s, &p) in sums.iter_mut().zip(row) {
                    *s += p.to_f32();
                }
            }
            sums
        })
        .collect();
    let mut column_sums = vec![0.0f32; e];
    for sums in &partial_sums {
        for (total, s) in column_sums.iter_mut().zip(sums) {
            *total += s;
        }
    }
    let weighted: f32 = column_sums.iter().zip(tokens_per_expert).map(|(s, n)| s * n).sum();
    config.scale() * weighted
}

/// The load-balancing loss, backward:
/// `grad_probs[t, e] = scale * tokens_per_expert[e] * grad_loss`.
pub fn aux_loss_backward<T: Real>(config: &AuxLossConfig, grad_loss: f32, tokens_per_expert: &[f32], grad_probs: &mut [T]) {
    let row: Vec<T> = tokens_per_expert.iter().map(|&n| T::from_f32(config.scale() * n * grad_loss)).collect();
    grad_probs
        .par_chunks_mut(config.num_experts)
        .with_min_len(ROWS_PER_TASK)
        .for_each(|out| out.copy_from_slice(&row));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(e: usize, topk: usize, score_function: ScoreFunction) -> TopkConfig {
        TopkConfig { num_experts: e, topk, score_function, use_pre_softmax: false, num_groups: 1, group_topk: 1, scaling_factor: 1.0 }
    }

    fn chosen(keys: &[f32], k: usize) -> Vec<usize> {
        let mut out = Vec::new();
        top_k_indices(keys, k, |_| true, &mut out);
        out
    }

    #[test]
    fn ties_go_to_the_lower_index_and_nan_ranks_lowest() {
        assert_eq!(chosen(&[1.0, 3.0, 3.0, 2.0, 3.0], 2), [1, 2]);
        assert_eq!(chosen(&[f32::NAN, 0.0, f32::NEG_INFINITY, f32::NAN], 3), [1, 0, 2]);
        assert_eq!(chosen(&[5.0, 5.0, 5.0], 3), [0, 1, 2]);
    }

    #[test]
    fn group_limit_keeps_selection_inside_the_best_groups() {
        // 4 groups of 2; topk 2 from 2 groups, each group ranked by its best expert.
        // Group sums: g0 = 0.9, g1 = 0.8, g2 = 0.85, g3 = 0.1 -> groups 0 and 2.
        let logits = [0.9f32, -5.0, 0.8, 0.7, 0.85, -5.0, 0.1, 0.0];
        let mut cfg = config(8, 2, ScoreFunction::Softmax);
        cfg.num_groups = 4;
        cfg.group_topk = 2;
        let (mut probs, mut map) = ([0.0f32; 8], [0u8; 8]);
        topk_forward(&cfg, &logits, None, &mut probs, &mut map);
        assert_eq!(map, [1, 0, 0, 0, 1, 0, 0, 0]);
    }

    #[test]
    fn sigmoid_weights_are_normalised_and_scaled_and_bias_only_steers() {
        let logits = [0.0f32, 1.0, 2.0, -1.0];
        let bias = [10.0f32, 0.0, 0.0, 0.0];
        let mut cfg = config(4, 2, ScoreFunction::Sigmoid);
        cfg.scaling_factor = 2.0;
        let (mut probs, mut map) = ([0.0f32; 4], [0u8; 4]);
        topk_forward(&cfg, &logits, Some(&bias), &mut probs, &mut map);
        assert_eq!(map, [1, 0, 1, 0]);
        let (s0, s2) = (sigmoid(0.0), sigmoid(2.0));
        assert!((probs[0] - 2.0 * s0 / (s0 + s2)).abs() < 1e-6);
        assert!((probs[2] - 2.0 * s2 / (s0 + s2)).abs() < 1e-6);
    }

    #[test]
    fn sigmoids_that_underflow_are_normalised_by_their_shares() {
        // Every sigmoid here is 0 in f32 (e^-x overflows): the bias makes the choice, and
        // the weights are s_i / sum(s) (here the softmax of the chosen logits), not 0 / 0.
        let logits = [-95.0f32, -91.0, -100.0, -93.0];
        let bias = [0.3f32, 0.0, 0.2, 0.1];
        let mut cfg = config(4, 2, ScoreFunction::Sigmoid);
        cfg.scaling_factor = 2.0;
        let (mut probs, mut map) = ([0.0f32; 4], [0u8; 4]);
        topk_forward(&cfg, &logits, Some(&bias), &mut probs, &mut map);
        assert_eq!(map, [1, 0, 1, 0]);
        let share = 1.0 / (1.0 + (-5.0f64).exp());
        assert!((f64::from(probs[0]) - 2.0 * share).abs() < 1e-6, "{probs:?}");
        assert!((f64::from(probs[2]) - 2.0 * (1.0 - share)).abs() < 1e-6, "{probs:?}");
        check_backward(&cfg, &logits, Some(&bias));

        let (mut map, mut scores) = ([0u8; 4], [0.0f32; 4]);
        scores_forward(ScoreFunction::Sigmoid, 2, 4, &logits, &mut map, &mut scores);
        let total: f64 = logits.iter().map(|&x| f64::from(x + 91.0).exp()).sum();
        for (s, &x) in scores.iter().zip(&logits) {
            assert!((f64::from(*s) - f64::from(x + 91.0).exp() / total).abs() < 1e-6, "{scores:?}");
        }
        assert_eq!(map, [0, 1, 0, 1]);
    }

    /// The backward of `forward` (a function of one row) against central differences.
    fn check_backward(cfg: &TopkConfig, logits: &[f32], bias: Option<&[f32]>) {
        let e = logits.len();
        let grad: Vec<f32> = (0..e).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.3).collect();
        let loss = |x: &[f32]| -> f64 {
            let (mut probs, mut map) = (vec![0.0f32; e], vec![0u8; e]);
            topk_forward(cfg, x, bias, &mut probs, &mut map);
            probs.iter().zip(&grad).map(|(p, g)| f64::from(*p) * f64::from(*g)).sum()
        };
        let (mut probs, mut map) = (vec![0.0f32; e], vec![0u8; e]);
        topk_forward(cfg, logits, bias, &mut probs, &mut map);
        let mut analytic = vec![0.0f32; e];
        topk_backward(cfg, &grad, logits, &map, &mut analytic);
        let eps = 1e-3f32;
        for i in 0..e {
            let (mut up, mut down) = (logits.to_vec(), logits.to_vec());
            up[i] += eps;
            down[i] -= eps;
            let numeric = (loss(&up) - loss(&down)) / (2.0 * f64::from(eps));
            assert!((numeric - f64::from(analytic[i])).abs() < 2e-3, "{cfg:?} d/dx{i}: numeric {numeric}, analytic {}", analytic[i]);
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let logits = [0.3f32, -1.2, 2.0, 0.9, -0.4, 1.5, 0.0, -2.1];
        let mut cfg = config(8, 3, ScoreFunction::Softmax);
        cfg.scaling_factor = 1.7;
        check_backward(&cfg, &logits, None);
        cfg.use_pre_softmax = true;
        check_backward(&cfg, &logits, None);
        let mut cfg = config(8, 3, ScoreFunction::Sigmoid);
        check_backward(&cfg, &logits, Some(&[0.1, 0.0, -0.2, 0.3, 0.0, 0.0, 0.1, 0.0]));
        cfg.topk = 1;
        check_backward(&cfg, &logits, None);
    }

    #[test]
    fn scores_backward_matches_finite_differences() {
        let logits = [0.3f32, -1.2, 2.0, 0.9, -0.4];
        let grad = [0.5f32, -1.0, 0.25, 2.0, -0.75];
        for score_function in [ScoreFunction::Softmax, ScoreFunction::Sigmoid] {
            let loss = |x: &[f32]| -> f64 {
                let (mut map, mut scores) = ([0u8; 5], [0.0f32; 5]);
                scores_forward(score_function, 2, 5, x, &mut map, &mut scores);
                scores.iter().zip(&grad).map(|(s, g)| f64::from(*s) * f64::from(*g)).sum()
            };
            let mut analytic = [0.0f32; 5];
            scores_backward(score_function, 5, &grad, &logits, &mut analytic);
            for i in 0..5 {
                let (mut up, mut down) = (logits.to_vec(), logits.to_vec());
                up[i] += 1e-3;
                down[i] -= 1e-3;
                let numeric = (loss(&up) - loss(&down)) / 2e-3;
                assert!((numeric - f64::from(analytic[i])).abs() < 1e-3, "{score_function:?} d/dx{i}");
            }
        }
    }

    #[test]
    fn aux_loss_sums_columns_weighted_by_counts() {
        let cfg = AuxLossConfig { num_experts: 2, topk: 1, total_num_tokens: 4, coeff: 0.5 };
        let probs = [0.25f32, 0.75, 0.5, 0.5, 1.0, 0.0];
        // Column sums 1.75 and 1.25; scale = 0.5 * 2 / (1 * 16).
        let loss = aux_loss_forward(&cfg, &probs, &[3.0, 1.0]);
        assert!((loss - (1.75 * 3.0 + 1.25) / 16.0).abs() < 1e-7);
        let mut grad = [0.0f32; 6];
        aux_loss_backward(&cfg, 2.0, &[3.0, 1.0], &mut grad);
        assert_eq!(grad, [0.375, 0.125, 0.375, 0.125, 0.375, 0.125]);
    }
}
