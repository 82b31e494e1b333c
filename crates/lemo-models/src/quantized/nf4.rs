//! QLoRA's 4-bit NormalFloat with double quantization, as bitsandbytes'
//! `quantize_4bit(quant_type="nf4", blocksize=64, compress_statistics=True)` defines it: the
//! tensor is flattened into blocks of 64 values; each block stores its absolute maximum and, per
//! value, the index of the [`NF4_CODE`] entry nearest to `value / absmax`. The block maxima are
//! then quantized themselves ("double quantization"): their mean is subtracted, and the centered
//! maxima are quantized in blocks of 256 to 8 bits, each block scaled by its own absolute maximum
//! onto the signed dynamic map of [`dynamic_map`] (`create_dynamic_map(signed=True)`).
//! Dequantization: `absmax = map[q8] * absmax2 + mean`, `value = NF4_CODE[q4] * absmax`.

/// bitsandbytes' NF4 code book as published (the QLoRA paper, appendix E; these doubles are
/// the f32 values its kernels hold).
const NF4_PUBLISHED: [f64; 16] = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
];

/// [`NF4_PUBLISHED`] in f32 (exact).
pub const NF4_CODE: [f32; 16] = {
    let mut code = [0.0; 16];
    let mut i = 0;
    while i < 16 {
        code[i] = NF4_PUBLISHED[i] as f32;
        i += 1;
    }
    code
};

/// Values per NF4 block.
pub const BLOCK: usize = 64;
/// Block maxima per block of the second quantization.
pub const ABSMAX_BLOCK: usize = 256;

/// Device bits a value: a 4-bit code, an 8-bit code of its block's maximum per 64 values, an
/// f32 scale per 256 maxima (QLoRA's 4.127).
pub const BITS: f64 = 4.0 + 8.0 / BLOCK as f64 + 32.0 / (BLOCK * ABSMAX_BLOCK) as f64;

/// A tensor in NF4 with double quantization.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4 {
    /// One 4-bit index into [`NF4_CODE`] per value, the last block padded with the code of 0.
    pub codes: Vec<u8>,
    /// One 8-bit index into [`dynamic_map`] per block of [`BLOCK`] values.
    pub absmax_codes: Vec<u8>,
    /// The absolute maximum of each block of [`ABSMAX_BLOCK`] centered block maxima.
    pub absmax_scales: Vec<f32>,
    /// The mean of the block maxima.
    pub absmax_mean: f32,
}

/// `create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)`: for each exponent
/// `i < 7`, the midpoints of `2^i + 1` points evenly spaced over `[0.1, 1]`, times `10^(i - 6)`,
/// with both signs; then 0 and 1; sorted. Computed in f64 and rounded to f32 (bitsandbytes
/// computes the points in f32 with torch.linspace: the two can differ in the last bit).
pub fn dynamic_map() -> [f32; 256] {
    let mut data = Vec::with_capacity(256);
    for i in 0..7 {
        let points = (1usize << i) + 1;
        let bound = |k: usize| 0.1 + 0.9 * k as f64 / (points - 1) as f64;
        let scale = 10f64.powi(i - 6);
        for k in 0..points - 1 {
            let mean = (bound(k) + bound(k + 1)) / 2.0;
            data.extend([scale * mean, -scale * mean]);
        }
    }
    data.extend([0.0, 1.0]);
    data.sort_by(f64::total_cmp);
    let mut map = [0.0; 256];
    for (to, from) in map.iter_mut().zip(data) {
        *to = from as f32;
    }
    map
}

/// The index of the entry of sorted `code` nearest to `x` (ties to the lower entry).
fn nearest(code: &[f32], x: f32) -> u8 {
    let above = code.partition_point(|&c| c < x).min(code.len() - 1);
    let index = if above > 0
        && f64::from(x) - f64::from(code[above - 1]) <= f64::from(code[above]) - f64::from(x)
    {
        above - 1
    } else {
        above
    };
    index as u8
}

/// The block's absolute maximum, and `value * (1 / max)` for each value (0 for an all-zero block).
fn normalized(block: &[f32]) -> (f32, impl Iterator<Item = f32> + '_) {
    let max = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let inverse = if max > 0.0 { 1.0 / max } else { 0.0 };
    (max, block.iter().map(move |&v| v * inverse))
}

impl Nf4 {
    pub fn quantize(values: &[f32]) -> Self {
        let zero = nearest(&NF4_CODE, 0.0);
        // Each block: its maximum, then its codes (padded to a whole block).
        let coded = super::by_blocks(values, BLOCK, |part| {
            part.chunks(BLOCK)
                .map(|block| {
                    let (max, scaled) = normalized(block);
                    let mut codes = [zero; BLOCK];
                    for (code, x) in codes.iter_mut().zip(scaled) {
                        *code = nearest(&NF4_CODE, x);
                    }
                    (max, codes)
                })
                .collect()
        });
        let absmax: Vec<f32> = coded.iter().map(|(max, _)| *max).collect();
        let codes: Vec<u8> = coded.into_iter().flat_map(|(_, codes)| codes).collect();
        let mean = absmax.iter().map(|&a| f64::from(a)).sum::<f64>() / absmax.len().max(1) as f64;
        let absmax_mean = mean as f32;
        let centered: Vec<f32> = absmax.iter().map(|&a| a - absmax_mean).collect();
        let map = dynamic_map();
        let mut absmax_codes = Vec::with_capacity(centered.len());
        let mut absmax_scales = Vec::with_capacity(centered.len().div_ceil(ABSMAX_BLOCK));
        for block in centered.chunks(ABSMAX_BLOCK) {
            let (max, scaled) = normalized(block);
            absmax_codes.extend(scaled.map(|x| nearest(&map, x)));
            absmax_scales.push(max);
        }
        Self {
            codes,
            absmax_codes,
            absmax_scales,
            absmax_mean,
        }
    }

    /// The block maxima back: `map[q8] * absmax2 + mean`.
    pub fn absmax(&self) -> Vec<f32> {
        let map = dynamic_map();
        self.absmax_codes
            .iter()
            .enumerate()
            .map(|(i, &q)| {
                map[usize::from(q)] * self.absmax_scales[i / ABSMAX_BLOCK] + self.absmax_mean
            })
            .collect()
    }

    /// The first `count` values back: `NF4_CODE[q4] * absmax`.
    pub fn dequantize(&self, count: usize) -> Vec<f32> {
        let absmax = self.absmax();
        self.codes[..count]
            .iter()
            .enumerate()
            .map(|(i, &q)| NF4_CODE[usize::from(q)] * absmax[i / BLOCK])
            .collect()
    }
}
