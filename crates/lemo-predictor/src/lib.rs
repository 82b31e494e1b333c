//! LeMo's pattern predictors (section 4.2 of the paper): per layer, small networks estimate the
//! token-block informativeness of the attention block from the block's input, so that a
//! token-sparse pass does not compute the exact scores, a pass over the causal half of
//! `Q K^T`.
//!
//! A query predictor and a key predictor give one score per token block, `I(Q_m)` and
//! `I(K_n)`, whose product, weighed by the block distance, approximates the block score matrix,
//! `I(B_mn) = D(m - n) I(Q_m) I(K_n)`; key block `n`'s token-block score is then its column
//! mean over the query blocks that see it, as for exact scores
//! (`lemo_sparsity::informativeness`). Cost `O(s h r + (s / b)^2)` instead of `O(s^2 h)`.
//!
//! The MLP blocks need no predictor: their exact informativeness, the mean `|activation|` of a
//! token block, is a reduction of the activations their pass computes for every row anyway.
//!
//! The query and key predictors ([`scorer::Scorer`]) are three low-rank maps with ReLU between
//! them, giving each token's log-score from its RMS-normalized row, pooled per token block
//! (log of the mean score). They are trained offline on the frozen model's exact scores (the
//! scorers of every layer at once, [`stacked`]), pruned while their recall of the exactly kept
//! blocks holds (elastic size transformation, [`training`]), and saved as safetensors with a
//! JSON header ([`file`]). They select a fixed fraction of each sequence's blocks per layer,
//! the fraction the exact scores keep there ([`agreement::Selection`]). Prediction runs them
//! side by side, as one scorer that reads the block input once ([`prediction`]).

pub mod agreement;
pub mod file;
pub mod prediction;
pub mod predictor;
pub mod samples;
pub mod scorer;
pub mod stacked;
pub mod training;

pub use file::{Predictors, PredictorsError, PredictorsHeader};
pub use prediction::LayerPredictor;
pub use predictor::QueryKey;
