//! Making your own Burn transformer block token-sparse with `lemo-sparsity` and `lemo-kernels`
//! alone (no `lemo-models`): a pre-norm causal self-attention block that scores its token blocks,
//! keeps the informative half, runs on those rows only and adds its output back in place.
//!
//! ```sh
//! cargo run --release -p sparse-block
//! ```

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, ElementConversion, Int, Tensor};
use lemo_kernels::attention::{AttentionOptions, attention};
use lemo_kernels::fused::NormSaves;
use lemo_kernels::token_movement::{gather_rms_norm, scatter_add_rows};
use lemo_kernels::{CpuBackend, LemoBackend};
use lemo_sparsity::{KeptRows, informativeness};

/// A single-head-group attention block: `h + W_o attention(W_q x, W_k x, W_v x)`, `x = rms(h)`.
struct Block<B: Backend> {
    norm: Tensor<B, 1>,
    wq: Tensor<B, 2>,
    wk: Tensor<B, 2>,
    wv: Tensor<B, 2>,
    wo: Tensor<B, 2>,
    heads: usize,
}

impl<B: LemoBackend> Block<B> {
    fn new(hidden: usize, heads: usize, device: &B::Device) -> Self {
        let weight = || Tensor::random([hidden, hidden], Distribution::Normal(0.0, 0.05), device);
        Self {
            norm: Tensor::ones([hidden], device),
            wq: weight(),
            wk: weight(),
            wv: weight(),
            wo: weight().require_grad(),
            heads,
        }
    }

    /// `[batch, len, hidden] -> [batch, heads, len, head_dim]`.
    fn split(&self, x: Tensor<B, 3>) -> Tensor<B, 4> {
        let [batch, len, hidden] = x.dims();
        x.reshape([batch, len, self.heads, hidden / self.heads])
            .swap_dims(1, 2)
    }

    /// Token-block informativeness of the block's input, outside the graph.
    fn scores(&self, h: Tensor<B, 3>, block_size: usize) -> Tensor<B, 2> {
        let x =
            lemo_kernels::fused::rms_norm(h.detach(), self.norm.clone(), 1e-5, NormSaves::Input);
        let q = self.split(x.clone().matmul(self.wq.clone().unsqueeze()));
        let k = self.split(x.matmul(self.wk.clone().unsqueeze()));
        informativeness::attention(q, k, informativeness::BlockScoring::exact(block_size))
    }

    /// The block on the kept rows `rows: [batch, kept]` of `h` only.
    fn forward(&self, h: Tensor<B, 3>, rows: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let x = gather_rms_norm(
            h.clone(),
            rows.clone(),
            self.norm.clone(),
            1e-5,
            NormSaves::Input,
        );
        let [batch, kept, hidden] = x.dims();
        let project = |w: &Tensor<B, 2>| self.split(x.clone().matmul(w.clone().unsqueeze()));
        let head_dim = hidden / self.heads;
        let out = attention(
            project(&self.wq),
            project(&self.wk),
            project(&self.wv),
            AttentionOptions::causal(head_dim),
        )
        .swap_dims(1, 2)
        .reshape([batch, kept, hidden]);
        scatter_add_rows(h, rows, out.matmul(self.wo.clone().unsqueeze()))
    }
}

fn main() {
    type B = Autodiff<CpuBackend>;
    let device = Default::default();
    let (batch, seq, hidden, block_size) = (2, 512, 64, 32);
    let block = Block::<B>::new(hidden, 4, &device);
    let h = Tensor::<B, 3>::random(
        [batch, seq, hidden],
        Distribution::Normal(0.0, 1.0),
        &device,
    );

    let scores = block.scores(h.clone(), block_size);
    // Keep the blocks scoring at least their sequence's mean (a relative threshold of 1), the
    // first and last, and at least half of them.
    let kept = KeptRows::select(&scores, block_size, seq, 1.0, 0.5);
    println!(
        "kept {} of {seq} rows per sequence ({:.0}%)",
        kept.kept,
        100.0 * kept.fraction()
    );

    let out = block.forward(h.clone(), kept.to_tensor(&device));
    let grads = out.clone().sum().backward();
    let unchanged = (out - h)
        .abs()
        .sum_dim(2)
        .equal_elem(0.0)
        .int()
        .sum()
        .into_scalar()
        .elem::<i64>();
    println!(
        "rows the block left untouched: {unchanged} of {}; gradient of W_o: {:?}",
        batch * seq,
        block.wo.grad(&grads).map(|g| g.dims())
    );
}
