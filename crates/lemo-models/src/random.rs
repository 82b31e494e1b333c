//! Seeded random values that are the same on every device and backend.

use burn::tensor::{Distribution, TensorData};

/// f32 values of `shape` drawn from `distribution` by a host generator seeded with `seed` and
/// `name`: the same on every device, and a different stream per tensor name so that adding a
/// tensor does not shift the others.
pub fn seeded_random(
    name: &str,
    seed: u64,
    shape: &[usize],
    distribution: Distribution,
) -> TensorData {
    use rand::SeedableRng;
    let seed = name.bytes().fold(seed, |h, b| {
        h.wrapping_mul(0x100000001b3).wrapping_add(b as u64)
    });
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    TensorData::random::<f32, _, _>(shape.to_vec(), distribution, &mut rng)
}
