//! LeMo's pattern predictors: per layer, one network estimates the informativeness of each
//! query block and one of each key block from the token embeddings `x`; their outer product
//! approximates the block score matrix, `I^(B_mn) = I^(Q_m) * I^(K_n)`, at `O(s h^2 + s^2/b^2)`
//! cost instead of the `O(s^2 h)` of exact scores.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Tensor, backend::Backend};

/// Three low-rank matrices with ReLU between them: `hidden -> rank -> rank -> 1`.
#[derive(Module, Debug)]
pub struct BlockScorer<B: Backend> {
    pub down: Linear<B>,
    pub middle: Linear<B>,
    pub out: Linear<B>,
}

impl<B: Backend> BlockScorer<B> {
    pub fn new(hidden: usize, rank: usize, device: &B::Device) -> Self {
        Self {
            down: LinearConfig::new(hidden, rank).init(device),
            middle: LinearConfig::new(rank, rank).init(device),
            out: LinearConfig::new(rank, 1).init(device),
        }
    }

    /// One score per block of `block_size` tokens of `x: [seq, hidden]`, each from the block's
    /// representative (mean) embedding. The last block may be shorter.
    pub fn forward(&self, x: Tensor<B, 2>, block_size: usize) -> Tensor<B, 1> {
        let [seq, hidden] = x.dims();
        let blocks = seq.div_ceil(block_size);
        let representatives: Vec<Tensor<B, 2>> = (0..blocks)
            .map(|n| {
                x.clone()
                    .slice([n * block_size..((n + 1) * block_size).min(seq), 0..hidden])
                    .mean_dim(0)
            })
            .collect();
        let h = relu(self.down.forward(Tensor::cat(representatives, 0)));
        let h = relu(self.middle.forward(h));
        self.out.forward(h).reshape([blocks])
    }
}

/// The pair of predictors of one layer.
#[derive(Module, Debug)]
pub struct LayerPredictor<B: Backend> {
    pub query: BlockScorer<B>,
    pub key: BlockScorer<B>,
}

impl<B: Backend> LayerPredictor<B> {
    pub fn new(hidden: usize, rank: usize, device: &B::Device) -> Self {
        Self {
            query: BlockScorer::new(hidden, rank, device),
            key: BlockScorer::new(hidden, rank, device),
        }
    }

    /// Estimated causal block scores `[blocks, blocks]`: `I^(Q_m) I^(K_n)` for `m >= n`, zero above
    /// the diagonal (a query block never sees later key blocks).
    pub fn block_scores(&self, x: Tensor<B, 2>, block_size: usize) -> Tensor<B, 2> {
        let query = self.query.forward(x.clone(), block_size);
        let key = self.key.forward(x, block_size);
        let [blocks] = query.dims();
        let outer = query.reshape([blocks, 1]).matmul(key.reshape([1, blocks]));
        outer.tril(0)
    }

    /// Kept token-block indices under `threshold`, from the estimated scores (see
    /// [`lemo_sparsity::informativeness::token_block_informativeness`]).
    pub fn kept_blocks(&self, x: Tensor<B, 2>, block_size: usize, threshold: f32) -> Vec<usize> {
        let scores = self.block_scores(x, block_size);
        let [blocks, _] = scores.dims();
        let token_blocks = lemo_sparsity::informativeness::token_block_informativeness(
            scores.reshape([1, blocks, blocks]),
        );
        let values: Vec<f32> = token_blocks
            .into_data()
            .convert::<f32>()
            .into_vec()
            .expect("f32 scores");
        lemo_sparsity::selection::kept_blocks(&values, threshold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::Distribution;

    #[test]
    fn block_scores_are_the_causal_outer_product_of_the_two_predictors() {
        let device = Default::default();
        let predictor = LayerPredictor::<NdArray>::new(16, 4, &device);
        let x = Tensor::<NdArray, 2>::random([70, 16], Distribution::Normal(0.0, 1.0), &device);
        let scores = predictor.block_scores(x.clone(), 32);
        assert_eq!(scores.dims(), [3, 3]);
        let q: Vec<f32> = predictor
            .query
            .forward(x.clone(), 32)
            .into_data()
            .to_vec()
            .unwrap();
        let k: Vec<f32> = predictor
            .key
            .forward(x.clone(), 32)
            .into_data()
            .to_vec()
            .unwrap();
        let s: Vec<f32> = scores.into_data().to_vec().unwrap();
        for m in 0..3 {
            for n in 0..3 {
                let expected = if m >= n { q[m] * k[n] } else { 0.0 };
                assert!((s[m * 3 + n] - expected).abs() < 1e-5);
            }
        }
        let kept = predictor.kept_blocks(x, 32, f32::INFINITY);
        assert_eq!(kept, vec![0, 2]);
    }
}
