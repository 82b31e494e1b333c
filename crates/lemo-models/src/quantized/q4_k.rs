//! A Q4_K quantizer (for `--quantize-base q4_k`): ggml's block layout, each super-block of 256
//! values as eight sub-blocks of 32 with `x = d * scale_j * q - dmin * min_j`, `q` 4 bits and
//! `scale_j`, `min_j` 6 bits. Scales and minimums are taken from each sub-block's range (rounded up
//! so that the range stays covered), without the search over candidate scales that llama.cpp's
//! quantizer runs: the blocks are valid Q4_K, somewhat less accurate than llama.cpp's.

use half::f16;

const SUPER: usize = 256;
const SUB: usize = 32;

/// `values` (a whole number of super-blocks) as Q4_K blocks.
pub fn quantize(values: &[f32]) -> Vec<u8> {
    values.chunks_exact(SUPER).flat_map(block).collect()
}

fn block(x: &[f32]) -> Vec<u8> {
    // Sub-block j covers [-min_j, -min_j + 15 scale_j], min_j >= 0 as ggml stores it.
    let ranges: Vec<(f32, f32)> = x
        .chunks_exact(SUB)
        .map(|sub| {
            let low = sub.iter().fold(0.0f32, |m, &v| m.min(v));
            let high = sub.iter().fold(f32::MIN, |m, &v| m.max(v));
            ((high - low) / 15.0, -low)
        })
        .collect();
    let max_scale = ranges.iter().fold(0.0f32, |m, r| m.max(r.0));
    let max_min = ranges.iter().fold(0.0f32, |m, r| m.max(r.1));
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    let six_bits = |v: f32, unit: f32| {
        if unit > 0.0 {
            (v / unit).ceil().clamp(0.0, 63.0) as u8
        } else {
            0
        }
    };
    let scales: Vec<(u8, u8)> = ranges
        .iter()
        .map(|&(s, m)| (six_bits(s, d.to_f32()), six_bits(m, dmin.to_f32())))
        .collect();
    let mut codes = [0u8; SUPER];
    for (j, sub) in x.chunks_exact(SUB).enumerate() {
        let step = d.to_f32() * f32::from(scales[j].0);
        let offset = dmin.to_f32() * f32::from(scales[j].1);
        for (i, &v) in sub.iter().enumerate() {
            codes[SUB * j + i] = if step > 0.0 {
                ((v + offset) / step).round().clamp(0.0, 15.0) as u8
            } else {
                0
            };
        }
    }
    let mut out = Vec::with_capacity(16 + SUPER / 2);
    out.extend(d.to_le_bytes());
    out.extend(dmin.to_le_bytes());
    out.extend(pack_scales(&scales));
    for run in codes.chunks_exact(2 * SUB) {
        out.extend((0..SUB).map(|l| run[l] | (run[SUB + l] << 4)));
    }
    out
}

/// The 12 bytes of eight 6-bit scales and minimums, as ggml's Q4_K decoder reads them: the first
/// four plainly in bytes 0-3 and 4-7, the last four as low nibbles in bytes 8-11 with their top two
/// bits in the spare top bits of bytes 0-7.
fn pack_scales(scales: &[(u8, u8)]) -> [u8; 12] {
    let mut packed = [0u8; 12];
    for (j, &(scale, min)) in scales.iter().enumerate() {
        if j < 4 {
            packed[j] |= scale;
            packed[j + 4] |= min;
        } else {
            packed[j + 4] = (scale & 0x0f) | ((min & 0x0f) << 4);
            packed[j - 4] |= (scale >> 4) << 6;
            packed[j] |= (min >> 4) << 6;
        }
    }
    packed
}
