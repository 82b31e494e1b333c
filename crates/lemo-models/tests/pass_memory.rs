//! The passes over every row run outside the autodiff graph: a norm's `value` records no node,
//! so nothing it computes outlives its output until the step's backward pass, even with a
//! trainable weight (LongLoRA) or an input that is a graph's leaf (a kept layer's input under an
//! activation plan). Burn's `detach` keeps a leaf's `require_grad`, so this is easy to lose.
//!
//! Counted by live heap bytes (a binary of its own: the allocator counts every thread). Each
//! check drops the output and measures what stays; `forward`, in the graph, shows the count sees
//! what a recorded node keeps.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use burn::backend::Autodiff;
use burn::module::Param;
use burn::tensor::{Distribution, Tensor};
use lemo_kernels::CpuBackend;
use lemo_models::norm::{LayerNorm, RmsNorm};

type B = Autodiff<CpuBackend>;

/// The system allocator, counting the bytes allocated and not yet freed.
struct LiveBytes;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for LiveBytes {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: LiveBytes = LiveBytes;

const SHAPE: [usize; 3] = [1, 512, 256];
/// One `[batch, seq, hidden]` f32 tensor.
const ACTIVATION_BYTES: isize = (SHAPE[0] * SHAPE[1] * SHAPE[2] * 4) as isize;

/// Live bytes that `norm` leaves behind once its output is dropped, with `x` a leaf that
/// requires its gradient.
fn left_behind(norm: impl Fn(Tensor<B, 3>) -> Tensor<B, 3>) -> isize {
    let device = Default::default();
    let x = Tensor::<B, 3>::random(SHAPE, Distribution::Normal(0.0, 1.0), &device).require_grad();
    let before = LIVE.load(Ordering::Relaxed);
    let out = norm(x.clone());
    assert_eq!(out.dims(), SHAPE);
    drop(out);
    let left = LIVE.load(Ordering::Relaxed) - before;
    drop(x);
    left
}

fn trainable(values: Tensor<B, 1>) -> Param<Tensor<B, 1>> {
    Param::from_tensor(values.require_grad())
}

#[test]
fn passes_over_every_row_keep_nothing_in_the_graph() {
    let device = Default::default();
    let hidden = SHAPE[2];
    let weight = || Tensor::<B, 1>::random([hidden], Distribution::Uniform(0.5, 1.5), &device);
    let bias = || Tensor::<B, 1>::random([hidden], Distribution::Uniform(-0.1, 0.1), &device);
    let mut rms = RmsNorm::new(weight(), 1e-5);
    let mut layer = LayerNorm::new(Some(weight()), Some(bias()), 1e-5);
    // What a tracked norm keeps, for the checks below to be able to fail.
    let kept = left_behind(|x| rms.forward(x));
    assert!(
        kept >= ACTIVATION_BYTES,
        "a recorded RMSNorm keeps a [seq, hidden] tensor: {kept} bytes left"
    );

    for trains in [false, true] {
        if trains {
            rms.weight = trainable(rms.weight.val());
            layer.weight = layer.weight.map(|w| trainable(w.val()));
            layer.bias = layer.bias.map(|b| trainable(b.val()));
        }
        let rms_left = left_behind(|x| rms.value(x));
        let layer_left = left_behind(|x| layer.value(x));
        println!(
            "trainable {trains}: RMSNorm value leaves {rms_left} bytes, LayerNorm value {layer_left}"
        );
        for (name, left) in [("RMSNorm", rms_left), ("LayerNorm", layer_left)] {
            assert!(
                left < ACTIVATION_BYTES / 8,
                "{name}::value with a trainable weight {trains} leaves {left} bytes behind its output"
            );
        }
    }
}
