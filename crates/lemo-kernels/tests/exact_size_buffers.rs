//! Exact-size buffers (`lemo_kernels::memory::exact_size_buffers`) on the wgpu pools: buffers of a
//! registered size reuse one another, and a change of shapes returns the free ones. In a test
//! binary of its own, so that no other test allocates on the device while the pool is read.

use burn::tensor::{DType, Device, Distribution, Tensor};
use lemo_kernels::WgpuBackend;
use lemo_kernels::memory::{exact_size_buffers, memory_stats, synchronize};

type B = WgpuBackend;

fn reserved(device: &Device<B>) -> u64 {
    synchronize::<B>(device);
    memory_stats::<B>(device).bytes_reserved
}

/// Allocates `count` live buffers of `shape` at once, then frees them.
fn fill(shape: [usize; 3], count: usize, device: &Device<B>) {
    let live: Vec<Tensor<B, 3>> = (0..count)
        .map(|_| Tensor::random(shape, Distribution::Default, device))
        .collect();
    synchronize::<B>(device);
    drop(live);
}

#[test]
fn registered_buffers_are_reused_and_returned_when_the_shapes_change() {
    let device = Default::default();
    let first = [1, 1024, 512]; // 2 MiB in f32
    let bytes = (first.iter().product::<usize>() * 4) as u64;
    exact_size_buffers::<B>(&device, DType::F32, &[first]);
    fill(first, 4, &device);
    let after_four = reserved(&device);
    // The same shapes again, and four more buffers of that size: the free slots serve them.
    exact_size_buffers::<B>(&device, DType::F32, &[first]);
    fill(first, 4, &device);
    assert_eq!(
        reserved(&device),
        after_four,
        "free exact-size slots are reused"
    );
    // Other shapes: the four free slots of the first size go back to the device; the new
    // shape's one slot is all that is added.
    let second = [1, 512, 512];
    exact_size_buffers::<B>(&device, DType::F32, &[second]);
    let after_change = reserved(&device);
    let added = (second.iter().product::<usize>() * 4) as u64;
    assert!(
        after_change + 4 * bytes <= after_four + added,
        "reserved {after_four} -> {after_change} bytes: the first shape's slots were kept"
    );
}
