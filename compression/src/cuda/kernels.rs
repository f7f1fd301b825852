//! CUDA C source of the compression kernels, compiled at run time by NVRTC.
//!
//! # Shape
//! Every kernel gives a thread one group of four consecutive elements, so that a warp reads
//! and writes 512 contiguous bytes of `f32` with one 16-byte access per thread (`float4`) and
//! the compressed side with one byte (2-bit) or half a byte (1-bit) per thread. 1-bit
//! quantize joins the two nibbles of a byte with a warp shuffle, so every byte is written
//! whole by one thread. Grid-stride loops cover any length with a grid sized to the device
//! (a few blocks per multiprocessor). The vector path needs 16-byte aligned `f32` buffers
//! (device allocations are); an unaligned buffer and the last partial group take the scalar
//! path, which performs the same operations element by element.
//!
//! # Bit-exactness
//! Additions and subtractions use explicitly rounded intrinsics (`__fadd_rn`, `__fsub_rn`) in
//! the CPU path's order, and the module is compiled with `--fmad=false --ftz=false`.

/// The kernels. Parameters: `n` elements; `out_len` compressed bytes (MXNet's padded size,
/// the padding written as zeros); thresholds as `f32`; `add` selects
/// dequantize-add (`out += decoded`) over dequantize (`out = decoded`).
pub const KERNELS_SRC: &str = r#"
typedef unsigned long long u64;

__device__ __forceinline__ u64 psnet_tid() {
    return (u64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ u64 psnet_stride() {
    return (u64)gridDim.x * blockDim.x;
}

__device__ __forceinline__ bool psnet_aligned16(const void* a, const void* b) {
    return ((((u64)a) | ((u64)b)) & 15ull) == 0ull;
}

/* 2-bit code of one element (3: +threshold, 2: -threshold, 0: nothing); updates r. */
__device__ __forceinline__ unsigned int psnet_q2(float& r, float g, float pos, float neg) {
    r = __fadd_rn(r, g);
    if (r >= pos) { r = __fsub_rn(r, pos); return 3u; }
    if (r <= neg) { r = __fsub_rn(r, neg); return 2u; }
    return 0u;
}

/* 1-bit code of one element (1: above the threshold); updates r. */
__device__ __forceinline__ unsigned int psnet_q1(float& r, float g, float threshold) {
    r = __fadd_rn(r, g);
    if (r > threshold) { r = __fsub_rn(r, 1.0f); return 1u; }
    r = __fadd_rn(r, 1.0f);
    return 0u;
}

__device__ __forceinline__ float psnet_d2(unsigned int code, float pos, float neg) {
    return code == 3u ? pos : (code == 2u ? neg : 0.0f);
}

extern "C" __global__ void psnet_quantize_2bit(
    const float* __restrict__ grad, float* __restrict__ residual, unsigned char* __restrict__ out,
    u64 n, u64 out_len, float pos, float neg)
{
    /* out_len may exceed the groups of n (MXNet pads to whole floats): those bytes are 0. */
    const u64 groups = out_len;
    const bool vec = psnet_aligned16(grad, residual);
    for (u64 g = psnet_tid(); g < groups; g += psnet_stride()) {
        const u64 i = g * 4;
        unsigned int byte = 0;
        if (vec && i + 4 <= n) {
            const float4 gv = reinterpret_cast<const float4*>(grad)[g];
            float4 r = reinterpret_cast<float4*>(residual)[g];
            byte = (psnet_q2(r.x, gv.x, pos, neg) << 6) | (psnet_q2(r.y, gv.y, pos, neg) << 4)
                 | (psnet_q2(r.z, gv.z, pos, neg) << 2) | psnet_q2(r.w, gv.w, pos, neg);
            reinterpret_cast<float4*>(residual)[g] = r;
        } else {
            for (unsigned int k = 0; k < 4; ++k) {
                if (i + k < n) {
                    float r = residual[i + k];
                    byte |= psnet_q2(r, grad[i + k], pos, neg) << (6 - 2 * k);
                    residual[i + k] = r;
                }
            }
        }
        out[g] = (unsigned char)byte;
    }
}

extern "C" __global__ void psnet_quantize_1bit(
    const float* __restrict__ grad, float* __restrict__ residual, unsigned char* __restrict__ out,
    u64 n, u64 out_len, float threshold)
{
    /* Two groups per byte; out_len may exceed what n needs (MXNet pads to whole floats). */
    const u64 groups = out_len * 2;
    const bool vec = psnet_aligned16(grad, residual);
    const unsigned int lane = threadIdx.x & 31u;
    /* The loop condition is the warp's (g - lane), so all 32 lanes stay for the shuffle. */
    for (u64 g = psnet_tid(); g - lane < groups; g += psnet_stride()) {
        unsigned int nibble = 0;
        if (g < groups) {
            const u64 i = g * 4;
            if (vec && i + 4 <= n) {
                const float4 gv = reinterpret_cast<const float4*>(grad)[g];
                float4 r = reinterpret_cast<float4*>(residual)[g];
                nibble = (psnet_q1(r.x, gv.x, threshold) << 3) | (psnet_q1(r.y, gv.y, threshold) << 2)
                       | (psnet_q1(r.z, gv.z, threshold) << 1) | psnet_q1(r.w, gv.w, threshold);
                reinterpret_cast<float4*>(residual)[g] = r;
            } else {
                for (unsigned int k = 0; k < 4; ++k) {
                    if (i + k < n) {
                        float r = residual[i + k];
                        nibble |= psnet_q1(r, grad[i + k], threshold) << (3 - k);
                        residual[i + k] = r;
                    }
                }
            }
        }
        /* Even groups hold a byte's high nibble (its first four elements). */
        const unsigned int low = __shfl_down_sync(0xffffffffu, nibble, 1);
        if ((lane & 1u) == 0u && g < groups) {
            out[g >> 1] = (unsigned char)((nibble << 4) | low);
        }
    }
}

extern "C" __global__ void psnet_dequantize_2bit(
    const unsigned char* __restrict__ in, float* __restrict__ out,
    u64 n, float pos, float neg, int add)
{
    const u64 groups = (n + 3) / 4;
    const bool vec = psnet_aligned16(out, out);
    for (u64 g = psnet_tid(); g < groups; g += psnet_stride()) {
        const unsigned int byte = in[g];
        const u64 i = g * 4;
        if (vec && i + 4 <= n) {
            float4 v = make_float4(psnet_d2((byte >> 6) & 3u, pos, neg), psnet_d2((byte >> 4) & 3u, pos, neg),
                                   psnet_d2((byte >> 2) & 3u, pos, neg), psnet_d2(byte & 3u, pos, neg));
            if (add) {
                const float4 o = reinterpret_cast<const float4*>(out)[g];
                v = make_float4(__fadd_rn(o.x, v.x), __fadd_rn(o.y, v.y), __fadd_rn(o.z, v.z), __fadd_rn(o.w, v.w));
            }
            reinterpret_cast<float4*>(out)[g] = v;
        } else {
            for (unsigned int k = 0; k < 4; ++k) {
                if (i + k < n) {
                    const float v = psnet_d2((byte >> (6 - 2 * k)) & 3u, pos, neg);
                    out[i + k] = add ? __fadd_rn(out[i + k], v) : v;
                }
            }
        }
    }
}

extern "C" __global__ void psnet_dequantize_1bit(
    const unsigned char* __restrict__ in, float* __restrict__ out, u64 n, int add)
{
    const u64 groups = (n + 3) / 4;
    const bool vec = psnet_aligned16(out, out);
    for (u64 g = psnet_tid(); g < groups; g += psnet_stride()) {
        const unsigned int byte = in[g >> 1];
        const unsigned int nibble = (g & 1ull) ? (byte & 15u) : (byte >> 4);
        const u64 i = g * 4;
        if (vec && i + 4 <= n) {
            float4 v = make_float4((nibble & 8u) ? 1.0f : -1.0f, (nibble & 4u) ? 1.0f : -1.0f,
                                   (nibble & 2u) ? 1.0f : -1.0f, (nibble & 1u) ? 1.0f : -1.0f);
            if (add) {
                const float4 o = reinterpret_cast<const float4*>(out)[g];
                v = make_float4(__fadd_rn(o.x, v.x), __fadd_rn(o.y, v.y), __fadd_rn(o.z, v.z), __fadd_rn(o.w, v.w));
            }
            reinterpret_cast<float4*>(out)[g] = v;
        } else {
            for (unsigned int k = 0; k < 4; ++k) {
                if (i + k < n) {
                    const float v = (nibble & (8u >> k)) ? 1.0f : -1.0f;
                    out[i + k] = add ? __fadd_rn(out[i + k], v) : v;
                }
            }
        }
    }
}
"#;
