//! f32 values on the wire: little-endian, read from byte slices of any alignment (received
//! segments start wherever the frame put them).

#[cfg(not(target_endian = "little"))]
compile_error!(
    "psnet's kv store sends f32 arrays as their in-memory bytes: little-endian hosts only"
);

/// The wire bytes of `values` (no copy).
pub fn as_bytes(values: &[f32]) -> &[u8] {
    bytemuck::cast_slice(values)
}

/// Number of f32 in `bytes`, or None if it is not a whole number of them.
pub fn f32_count(bytes: &[u8]) -> Option<usize> {
    (bytes.len() % 4 == 0).then_some(bytes.len() / 4)
}

/// `dst = bytes` as f32. Lengths must match (checked by the caller).
pub fn copy_from_le(dst: &mut [f32], bytes: &[u8]) {
    debug_assert_eq!(dst.len() * 4, bytes.len());
    if let Ok(src) = bytemuck::try_cast_slice::<u8, f32>(bytes) {
        dst.copy_from_slice(src);
    } else {
        for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
}

/// `dst += bytes` as f32, element by element in order. Lengths must match.
pub fn add_from_le(dst: &mut [f32], bytes: &[u8]) {
    debug_assert_eq!(dst.len() * 4, bytes.len());
    if let Ok(src) = bytemuck::try_cast_slice::<u8, f32>(bytes) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d += *s;
        }
    } else {
        for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
            *d += f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unaligned_input_reads_the_same() {
        let values = [1.5f32, -2.25, 3.0e-3, f32::MAX];
        let mut raw = vec![0u8; 1];
        raw.extend_from_slice(as_bytes(&values));
        let unaligned = &raw[1..];
        let mut out = [0f32; 4];
        copy_from_le(&mut out, unaligned);
        assert_eq!(out, values);
        add_from_le(&mut out, unaligned);
        assert_eq!(out, values.map(|v| v + v));
        assert_eq!(f32_count(unaligned), Some(4));
        assert_eq!(f32_count(&raw[..3]), None);
    }
}
