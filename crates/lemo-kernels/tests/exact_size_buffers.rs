//! Exact-size buffers (`lemo_kernels::memory::exact_size_buffers`) on the wgpu pools: buffers of a
//! registered size reuse one another, a change of shapes returns the free ones, and idle ones
//! go back to the device between layers near the pool budget (`LayerBuffers`). In a test binary of its
//! own, its tests one at a time, so that nothing else allocates on the device while the pool is
//! read.

use std::sync::{Mutex, MutexGuard};

use burn::tensor::{DType, Device, Distribution, Tensor};
use lemo_kernels::WgpuBackend;
use lemo_kernels::memory::{
    LayerBuffers, exact_size_buffers, memory_stats, pooled_buffer_limit, set_pool_budget,
    synchronize,
};

type B = WgpuBackend;

/// Held by each test: the pools are read, so nothing else may allocate meanwhile.
fn alone() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

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
    let _alone = alone();
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

#[test]
fn idle_buffers_go_back_between_layers_near_the_pool_budget() {
    let _alone = alone();
    let device = Default::default();
    let Some(limit) = pooled_buffer_limit::<B>(&device) else {
        println!("skipped: this wgpu build gives every buffer its own allocation");
        return;
    };
    let shape = [1, 1024, 512]; // 2 MiB in f32
    let bytes = (shape.iter().product::<usize>() * 4) as u64;
    let page = 16 * limit;
    if page > 1 << 30 {
        println!("skipped: the pool's largest page is {page} bytes, too many buffers to fill here");
        return;
    }
    // A budget when the pass starts, so that it measures how the pools grow from there.
    set_pool_budget::<B>(&device, Some(u64::MAX / 2));
    let mut buffers = LayerBuffers::<B>::new(&device, DType::F32, vec![shape]);
    // A "layer" that leaves a page and more of idle buffers.
    let many = (page / bytes + 2) as usize;
    fill(shape, many, &device);
    let idle = reserved(&device);
    // No budget: nothing is released however much lies idle.
    set_pool_budget::<B>(&device, None);
    assert!(!buffers.between_layers());
    // Room for another layer's growth (the first one's: `many` buffers) beside what the pools
    // hold: nothing either.
    set_pool_budget::<B>(&device, Some(idle + 2 * page));
    assert!(!buffers.between_layers());
    assert_eq!(reserved(&device), idle, "{many} idle buffers are kept");
    // Without that room: the idle buffers go back, but for the one slot registering the shape
    // makes.
    set_pool_budget::<B>(&device, Some(idle + page / 2));
    assert!(buffers.between_layers());
    let released = reserved(&device);
    assert!(
        released + (many as u64 - 1) * bytes <= idle,
        "reserved {idle} -> {released} bytes after releasing {many} idle buffers of {bytes}"
    );
    // Less than a page idle: kept, even at the budget.
    let few = (page / bytes / 2) as usize;
    fill(shape, few, &device);
    let kept = reserved(&device);
    set_pool_budget::<B>(&device, Some(kept));
    assert!(!buffers.between_layers());
    assert_eq!(reserved(&device), kept, "{few} idle buffers are kept");
    // The size is still served from its own slots: one buffer of it adds nothing.
    fill(shape, 1, &device);
    assert_eq!(reserved(&device), kept, "the shape stays registered");
    set_pool_budget::<B>(&device, None);
}
