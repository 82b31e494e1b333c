//! Contextual token sparsity (LeMo): which token blocks each block of a layer keeps.
//!
//! A layer's attention block and MLP block each train on their *kept rows* only. Which rows are
//! kept comes from informativeness scores of token blocks (`block_size` consecutive tokens):
//!
//! - attention: `I(B_mn) = max over (i, j) in B_mn of sum_h relu(q^h_i . k^h_j / sqrt(d)) / H`
//!   ([`informativeness::attention`], tile by tile on the GPU, never `S x S` in memory), and a
//!   key block's informativeness is the mean of its column over the query blocks that see it;
//! - MLP: the mean absolute activation (`silu(gate) * up`, or OPT's ReLU output) of the block's
//!   tokens ([`informativeness::mlp`]).
//!
//! Each block keeps a fixed fraction of its sequence's token blocks, the best-scoring ones, a
//! count known before the scores: [`best_blocks`] selects them on the device, so a training step
//! never waits for its scores. The first block (the attention sink) and the last block are always
//! kept, and a floor on the kept fraction holds whatever the scores. The fractions come from
//! calibration ([`calibration`]): each layer's threshold starts at the layer's mean score and is
//! refined toward a target kept fraction at the least loss, and the layer keeps the fraction of
//! the profiled blocks its threshold keeps ([`Thresholds`]). A threshold without a fraction keeps
//! the blocks scoring at least it times the mean score of the sequence's blocks, selected on the
//! host ([`selection`]).
//!
//! Two ways to use a kept set. The simplest, below, runs the block on the kept rows alone and lets
//! the other rows pass through unchanged: right for a model trained that way, but a pretrained
//! model's outputs fall apart when its blocks are skipped per token (SmolLM2-135M: perplexity
//! 29.6 -> 4,479 with MLP blocks skipped for half the tokens). `lemo-models` therefore keeps the
//! forward pass exact: each block is computed for every row outside the graph, and the graph is
//! built on the kept rows with `lemo_kernels::known_value` (`matmul_with_value`, `with_value`)
//! and `lemo_kernels::attention::attention_with_value`, so only the saved activations and the
//! backward pass are token-sparse.
//!
//! The forward-skipping form, from any Burn model with `lemo-kernels` for the token movement:
//!
//! ```no_run
//! # use burn::tensor::{Tensor, Int, backend::Backend};
//! # use lemo_kernels::{LemoBackend, fused::NormSaves, token_movement::{gather_rms_norm, scatter_add_rows}};
//! # use lemo_sparsity::{informativeness, selection::KeptRows};
//! # fn block<B: LemoBackend>(h: Tensor<B, 3>, q: Tensor<B, 4>, k: Tensor<B, 4>, w: Tensor<B, 1>,
//! #     f: impl Fn(Tensor<B, 3>) -> Tensor<B, 3>) -> Tensor<B, 3> {
//! let [batch, seq, _] = h.dims();
//! // q, k: [batch, heads, seq, head_dim] of every token, computed without a graph.
//! let scores = informativeness::attention(q, k, informativeness::BlockScoring::exact(64));
//! let kept = KeptRows::select(&scores, 64, seq, 0.5, 0.25);
//! let rows = kept.to_tensor::<B>(&h.device());
//! let y = gather_rms_norm(h.clone(), rows.clone(), w, 1e-5, NormSaves::Input); // only the kept rows
//! scatter_add_rows(h, rows, f(y)) // added in place into those rows
//! # }
//! ```

pub mod best_blocks;
pub mod calibration;
pub mod informativeness;
pub mod selection;
pub mod thresholds;

pub use selection::KeptRows;
pub use thresholds::{LayerThresholds, PerBlock, Selection, Thresholds};
