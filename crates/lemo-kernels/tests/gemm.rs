//! Autodiff of the GEMM entry point (wgpu, f32; the cuBLASLt path is checked on the GPU by
//! `cargo xtask gpu-test`) against products written out on the host in f64: 2-D, batched, a
//! weight shared by the batch, and transposed views. Output and both input gradients.

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use lemo_kernels::{WgpuBackend, gemm};
use lemo_test_support::{assert_close_values, exclusive_generator, random, seed_backend};

type B = Autodiff<WgpuBackend>;

/// f32 products of at most 20 terms against exact ones.
const TOLERANCE: f64 = 1e-5;

/// A `[batch, rows, cols]` matrix stack on the host (a 2-D tensor is a batch of one).
struct Host {
    batch: usize,
    rows: usize,
    cols: usize,
    values: Vec<f64>,
}

impl Host {
    fn of<const D: usize>(tensor: &Tensor<B, D>) -> Self {
        let dims = tensor.dims();
        let (rows, cols) = (dims[D - 2], dims[D - 1]);
        let values: Vec<f32> = tensor.to_data().convert::<f32>().into_vec().unwrap();
        Self {
            batch: values.len() / (rows * cols),
            rows,
            cols,
            values: values.into_iter().map(f64::from).collect(),
        }
    }

    fn at(&self, b: usize, r: usize, c: usize) -> f64 {
        // A batch of one is shared by every batch entry.
        let b = if self.batch == 1 { 0 } else { b };
        self.values[(b * self.rows + r) * self.cols + c]
    }

    fn transposed(&self) -> Self {
        let mut values = Vec::with_capacity(self.values.len());
        for b in 0..self.batch {
            for c in 0..self.cols {
                for r in 0..self.rows {
                    values.push(self.at(b, r, c));
                }
            }
        }
        Self {
            rows: self.cols,
            cols: self.rows,
            values,
            ..*self
        }
    }

    /// `self x other`, batch entries paired (a batch of one broadcast).
    fn times(&self, other: &Host) -> Self {
        assert_eq!(self.cols, other.rows);
        let batch = self.batch.max(other.batch);
        let mut values = vec![0.0; batch * self.rows * other.cols];
        for b in 0..batch {
            for r in 0..self.rows {
                for c in 0..other.cols {
                    values[(b * self.rows + r) * other.cols + c] = (0..self.cols)
                        .map(|k| self.at(b, r, k) * other.at(b, k, c))
                        .sum();
                }
            }
        }
        Self {
            batch,
            rows: self.rows,
            cols: other.cols,
            values,
        }
    }

    /// Sums the batch down to `batch` entries (the gradient of a broadcast operand).
    fn summed_to(self, batch: usize) -> Self {
        if batch == self.batch {
            return self;
        }
        assert_eq!(batch, 1);
        let size = self.rows * self.cols;
        let mut values = vec![0.0; size];
        for chunk in self.values.chunks(size) {
            values.iter_mut().zip(chunk).for_each(|(s, v)| *s += v);
        }
        Self {
            batch,
            values,
            ..self
        }
    }

    fn assert_matches<const D: usize>(&self, what: &str, tensor: Tensor<B, D>) {
        let actual: Vec<f32> = tensor.into_data().convert::<f32>().into_vec().unwrap();
        let expected: Vec<f32> = self.values.iter().map(|&v| v as f32).collect();
        assert_close_values(what, &actual, &expected, TOLERANCE);
    }
}

fn check<const D: usize>(lhs: Tensor<B, D>, rhs: Tensor<B, D>) {
    let lhs = lhs.detach().require_grad();
    let rhs = rhs.detach().require_grad();
    let out = gemm::matmul(lhs.clone(), rhs.clone());
    let upstream = random::<B, D>(out.dims(), &out.device());
    let grads = (out.clone() * upstream.clone()).sum().backward();

    let (a, b, up) = (Host::of(&lhs), Host::of(&rhs), Host::of(&upstream));
    a.times(&b).assert_matches("out", out);
    up.times(&b.transposed()).summed_to(a.batch).assert_matches(
        "d lhs",
        Tensor::<B, D>::from_inner(lhs.grad(&grads).unwrap()),
    );
    a.transposed().times(&up).summed_to(b.batch).assert_matches(
        "d rhs",
        Tensor::<B, D>::from_inner(rhs.grad(&grads).unwrap()),
    );
}

/// Holds the crate's generator, seeded with the test seed, for the test's draws.
fn seeded() -> std::sync::MutexGuard<'static, ()> {
    let generator = exclusive_generator();
    seed_backend::<B>(&Default::default());
    generator
}

fn normal<const D: usize>(shape: [usize; D]) -> Tensor<B, D> {
    random(shape, &Default::default())
}

#[test]
fn two_dimensional() {
    let _seeded = seeded();
    check(normal([33, 20]), normal([20, 17]));
}

#[test]
fn batched() {
    let _seeded = seeded();
    check(normal([3, 9, 20]), normal([3, 20, 11]));
}

#[test]
fn shared_weight_as_one_tall_product() {
    let _seeded = seeded();
    check(normal([4, 9, 20]), normal([1, 20, 11]));
}

#[test]
fn transposed_views() {
    let _seeded = seeded();
    // `x W^T` with `W [out, in]`, and `x^T y` (the weight-gradient form).
    check(normal([2, 9, 20]), normal([1, 11, 20]).swap_dims(1, 2));
    check(normal([20, 9]).transpose(), normal([20, 13]));
}
