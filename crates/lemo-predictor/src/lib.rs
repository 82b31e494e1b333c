//! LeMo's pattern predictors (section 4.2 of the paper): per layer, small networks estimate the
//! token-block informativeness of the attention block and of the MLP block from the block's
//! input, so that a token-sparse pass does not compute exact scores.
//!
//! - Attention: a query predictor and a key predictor give one score per token block,
//!   `I(Q_m)` and `I(K_n)`, whose product approximates the block score matrix,
//!   `I(B_mn) = I(Q_m) I(K_n)`; key block `n`'s token-block score is then its column mean over
//!   the query blocks that see it, `I(K_n) mean_{m >= n} I(Q_m)`, as for exact scores
//!   (`lemo_sparsity::informativeness`). Cost `O(s h r + (s / b)^2)` instead of `O(s^2 h)`.
//! - MLP: a sketch of the MLP's own input map ([`sketch::MlpSketch`]): `k` of its `f` channels,
//!   chosen for how much of the exact scores' variation between blocks they carry, with learned
//!   weights; the block's score is the weighted mean `|activation|` of those channels.
//!
//! The query and key predictors ([`scorer::Scorer`]) are three low-rank maps with ReLU between
//! them, giving each token's log-score from its RMS-normalized row, pooled per token block
//! (log of the mean score). Both kinds are trained offline on the frozen model's exact scores
//! ([`training`]; the scorers of every layer at once, [`stacked`]), pruned while their recall
//! of the exactly kept blocks holds (elastic size transformation), and saved as safetensors
//! with a JSON header ([`file`]).

pub mod agreement;
pub mod file;
pub mod predictor;
pub mod scorer;
pub mod sketch;
pub mod stacked;
pub mod training;

pub use file::{Predictors, PredictorsError, PredictorsHeader};
pub use predictor::{BlockPredictor, LayerPredictors, QueryKey};
pub use sketch::{MlpInputMap, MlpSketch};
