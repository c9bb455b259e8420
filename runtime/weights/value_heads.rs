//! The Qwen3.5 value-head order, both directions: Hugging Face keeps the linear-attention value
//! heads grouped by key head, llama.cpp's converter (`_reorder_v_heads`) tiles them.
//!
//! With `Hk` key heads, `Hv` value heads and `r = Hv / Hk` value heads per key head, value head
//! `j` of key head `k` sits at head `k·r + j` in Hugging Face (grouped) order and at head
//! `j·Hk + k` in GGUF (tiled) order. A value-head axis may have `unit` entries per head (value
//! channels: `unit = d_v`; per-head scalars such as `A` or `dt_bias`: `unit = 1`); entries keep
//! their offset inside the head. Both maps are the identity when `Hk = Hv`.
//!
//! The import (`import_qwen35`, GGUF → Hugging Face layout) and the FastFlowLM loader
//! (`model::fflm_layout`, a GGUF-derived file read in Hugging Face order) both use these maps.

/// The GGUF (tiled) index of Hugging Face (grouped) index `idx` on a value-head axis of
/// `value_heads` heads of `unit` entries each, with `key_heads` key heads.
pub fn hf_to_gguf(idx: usize, key_heads: usize, value_heads: usize, unit: usize) -> usize {
    if key_heads == value_heads || key_heads == 0 || unit == 0 {
        return idx;
    }
    let per_key = value_heads / key_heads;
    let (head, offset) = (idx / unit, idx % unit);
    let (key, j) = (head / per_key, head % per_key);
    (j * key_heads + key) * unit + offset
}

/// The Hugging Face (grouped) index of GGUF (tiled) index `idx`: the inverse of [`hf_to_gguf`].
pub fn gguf_to_hf(idx: usize, key_heads: usize, value_heads: usize, unit: usize) -> usize {
    if key_heads == value_heads || key_heads == 0 || unit == 0 {
        return idx;
    }
    let per_key = value_heads / key_heads;
    let (head, offset) = (idx / unit, idx % unit);
    let (j, key) = (head / key_heads, head % key_heads);
    (key * per_key + j) * unit + offset
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2 key heads, 4 value heads (r = 2): HF grouped order is (k0 j0, k0 j1, k1 j0, k1 j1),
    /// GGUF tiled order is (k0 j0, k1 j0, k0 j1, k1 j1).
    #[test]
    fn two_key_heads_four_value_heads_by_hand() {
        let (hk, hv) = (2, 4);
        let hf_to_gguf_heads: Vec<usize> = (0..hv).map(|i| hf_to_gguf(i, hk, hv, 1)).collect();
        assert_eq!(hf_to_gguf_heads, [0, 2, 1, 3]);
        let gguf_to_hf_heads: Vec<usize> = (0..hv).map(|i| gguf_to_hf(i, hk, hv, 1)).collect();
        assert_eq!(gguf_to_hf_heads, [0, 2, 1, 3]);
        // Units of 3 entries: HF entry 4 is offset 1 of HF head 1 (k0 j1) = GGUF head 2.
        assert_eq!(hf_to_gguf(4, hk, hv, 3), 2 * 3 + 1);
        assert_eq!(gguf_to_hf(2 * 3 + 1, hk, hv, 3), 4);
        // Heads labelled (key, j) in HF order land in tiled order.
        let hf = ["k0j0", "k0j1", "k1j0", "k1j1"];
        let mut gguf = [""; 4];
        for (i, label) in hf.iter().enumerate() {
            gguf[hf_to_gguf(i, hk, hv, 1)] = label;
        }
        assert_eq!(gguf, ["k0j0", "k1j0", "k0j1", "k1j1"]);
    }

    /// 2 key heads, 6 value heads (r = 3): a case where the two directions differ.
    #[test]
    fn two_key_heads_six_value_heads_by_hand() {
        let (hk, hv) = (2, 6);
        // HF head k·3 + j → GGUF head j·2 + k.
        let to_gguf: Vec<usize> = (0..hv).map(|i| hf_to_gguf(i, hk, hv, 1)).collect();
        assert_eq!(to_gguf, [0, 2, 4, 1, 3, 5]);
        let to_hf: Vec<usize> = (0..hv).map(|i| gguf_to_hf(i, hk, hv, 1)).collect();
        assert_eq!(to_hf, [0, 3, 1, 4, 2, 5]);
    }

    #[test]
    fn directions_are_inverses() {
        for (hk, hv) in [(1, 1), (2, 2), (2, 4), (2, 6), (4, 8), (16, 32), (3, 12)] {
            for unit in [1, 2, 5, 128] {
                let len = hv * unit;
                let mut seen = vec![false; len];
                for i in 0..len {
                    let g = hf_to_gguf(i, hk, hv, unit);
                    assert!(g < len, "hk {hk} hv {hv} unit {unit}: {i} → {g}");
                    assert!(!seen[g], "hk {hk} hv {hv} unit {unit}: {g} twice");
                    seen[g] = true;
                    assert_eq!(
                        gguf_to_hf(g, hk, hv, unit),
                        i,
                        "hk {hk} hv {hv} unit {unit}"
                    );
                    assert_eq!(hf_to_gguf(gguf_to_hf(i, hk, hv, unit), hk, hv, unit), i);
                }
            }
        }
    }

    #[test]
    fn equal_head_counts_are_the_identity() {
        for i in 0..40 {
            assert_eq!(hf_to_gguf(i, 4, 4, 10), i);
            assert_eq!(gguf_to_hf(i, 4, 4, 10), i);
        }
    }
}
