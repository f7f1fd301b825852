//! CUDA C source of the reduction kernels that collectives run on GPU buffers, compiled at
//! run time by NVRTC (see [`CudaReducer`](super::CudaReducer)).
//!
//! Each kernel combines a received piece (`src`, copied to the device) into a piece of the
//! caller's buffer (`dst`) element by element, with the operation psnet-collectives' host
//! path performs on the same element type: `op(dst, src)`, or `op(src, dst)` when
//! `remote_first` is set. Floating-point sums, products and quotients use explicitly rounded
//! intrinsics (and the module is compiled with `--fmad=false --ftz=false`); min and max pick
//! an operand as the host path does (the second one when it is smaller / larger or NaN);
//! integers wrap. Half-precision values are widened to `f32`, combined there and rounded
//! back to nearest-even, as the host path does, with conversions written out here so that
//! they need no CUDA header. The source has no include and no CUDA-only construct beyond
//! thread indices and the rounded intrinsics, so the tests compile and run it on the CPU too.

/// The kernels. `psnet_reduce_<type>(dst, src, n, op, remote_first)`: `op` 0 sum, 1 product,
/// 2 min, 3 max, 4 copy (`dst = src`). `psnet_divide_<type>(dst, n, divisor)` (floating-point
/// types: the end of an average; half types take the divisor's bits).
pub const REDUCE_KERNELS_SRC: &str = r#"
typedef unsigned char psnet_u8;
typedef unsigned short psnet_u16;
typedef unsigned int psnet_u32;
typedef unsigned long long psnet_u64;

#define PSNET_SUM 0
#define PSNET_PROD 1
#define PSNET_MIN 2
#define PSNET_MAX 3
#define PSNET_COPY 4

/* Every index below n, spread over the whole grid. */
#define PSNET_EACH(i, n) \
    for (psnet_u64 i = (psnet_u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (psnet_u64)gridDim.x * blockDim.x)

/* IEEE half to float: exact. A NaN keeps its payload and comes out quiet. */
__device__ __forceinline__ float psnet_f16_to_f32(psnet_u16 h) {
    psnet_u32 sign = (psnet_u32)(h & 0x8000u) << 16;
    psnet_u32 exp = (h >> 10) & 0x1fu;
    psnet_u32 man = h & 0x3ffu;
    psnet_u32 bits;
    if (exp == 0x1fu) {
        bits = man ? (sign | 0x7fc00000u | (man << 13)) : (sign | 0x7f800000u);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            /* Subnormal: shift the leading one up to the implicit bit's place. */
            psnet_u32 e = 113;
            while (!(man & 0x400u)) {
                man <<= 1;
                e -= 1;
            }
            bits = sign | (e << 23) | ((man & 0x3ffu) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    return __uint_as_float(bits);
}

/* Shifts m right by s (1..31), rounding to nearest, ties to even. */
__device__ __forceinline__ psnet_u32 psnet_shift_rne(psnet_u32 m, psnet_u32 s) {
    psnet_u32 kept = m >> s;
    psnet_u32 rest = m & ((1u << s) - 1u);
    psnet_u32 half = 1u << (s - 1u);
    return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

/* Float to IEEE half, rounded to nearest, ties to even. A NaN keeps the top of its payload
   and comes out quiet. */
__device__ __forceinline__ psnet_u16 psnet_f32_to_f16(float f) {
    psnet_u32 x = __float_as_uint(f);
    psnet_u32 sign = (x >> 16) & 0x8000u;
    psnet_u32 ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (psnet_u16)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    /* From halfway between the largest half (65504) and 65536 up: infinity. */
    if (ax >= 0x477ff000u) return (psnet_u16)(sign | 0x7c00u);
    if (ax < 0x38800000u) {
        /* Below the smallest normal half: a multiple of 2^-24, or zero. */
        psnet_u32 e = ax >> 23;
        if (e < 102u) return (psnet_u16)sign;
        psnet_u32 m = (ax & 0x7fffffu) | 0x800000u;
        return (psnet_u16)(sign | psnet_shift_rne(m, 126u - e));
    }
    /* Normal: rebias the exponent (a carry out of the mantissa is the next exponent). */
    return (psnet_u16)(sign | psnet_shift_rne(ax - 0x38000000u, 13u));
}

/* bfloat16 to float: exact. A NaN comes out quiet. */
__device__ __forceinline__ float psnet_bf16_to_f32(psnet_u16 h) {
    psnet_u32 bits = (psnet_u32)h << 16;
    if ((bits & 0x7fffffffu) > 0x7f800000u) bits |= 0x400000u;
    return __uint_as_float(bits);
}

/* Float to bfloat16, rounded to nearest, ties to even. A NaN comes out quiet. */
__device__ __forceinline__ psnet_u16 psnet_f32_to_bf16(float f) {
    psnet_u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (psnet_u16)((x >> 16) | 0x40u);
    return (psnet_u16)psnet_shift_rne(x, 16u);
}

__device__ __forceinline__ float psnet_combine_f32(int op, float a, float b) {
    switch (op) {
    case PSNET_SUM: return __fadd_rn(a, b);
    case PSNET_PROD: return __fmul_rn(a, b);
    case PSNET_MIN: return (b < a || b != b) ? b : a;
    default: return (b > a || b != b) ? b : a;
    }
}

__device__ __forceinline__ double psnet_combine_f64(int op, double a, double b) {
    switch (op) {
    case PSNET_SUM: return __dadd_rn(a, b);
    case PSNET_PROD: return __dmul_rn(a, b);
    case PSNET_MIN: return (b < a || b != b) ? b : a;
    default: return (b > a || b != b) ? b : a;
    }
}

/* Integers: sums and products wrap (computed unsigned, where wrapping is defined). */
#define PSNET_COMBINE_INT(name, T, U) \
    __device__ __forceinline__ T name(int op, T a, T b) { \
        switch (op) { \
        case PSNET_SUM: return (T)((U)a + (U)b); \
        case PSNET_PROD: return (T)((U)a * (U)b); \
        case PSNET_MIN: return b < a ? b : a; \
        default: return b > a ? b : a; \
        } \
    }
PSNET_COMBINE_INT(psnet_combine_i32, int, psnet_u32)
PSNET_COMBINE_INT(psnet_combine_i64, long long, psnet_u64)
PSNET_COMBINE_INT(psnet_combine_u8, psnet_u8, psnet_u32)

/* A reduce kernel over elements of type T combined by COMBINE, through WIDE values. */
#define PSNET_REDUCE(name, T, W, widen, narrow, combine) \
    extern "C" __global__ void name(T* dst, const T* src, psnet_u64 n, int op, \
                                    int remote_first) { \
        PSNET_EACH(i, n) { \
            if (op == PSNET_COPY) { \
                dst[i] = src[i]; \
            } else { \
                W d = widen(dst[i]); \
                W s = widen(src[i]); \
                dst[i] = narrow(remote_first ? combine(op, s, d) : combine(op, d, s)); \
            } \
        } \
    }
#define PSNET_SAME(x) (x)
PSNET_REDUCE(psnet_reduce_f32, float, float, PSNET_SAME, PSNET_SAME, psnet_combine_f32)
PSNET_REDUCE(psnet_reduce_f64, double, double, PSNET_SAME, PSNET_SAME, psnet_combine_f64)
PSNET_REDUCE(psnet_reduce_f16, psnet_u16, float, psnet_f16_to_f32, psnet_f32_to_f16,
             psnet_combine_f32)
PSNET_REDUCE(psnet_reduce_bf16, psnet_u16, float, psnet_bf16_to_f32, psnet_f32_to_bf16,
             psnet_combine_f32)
PSNET_REDUCE(psnet_reduce_i32, int, int, PSNET_SAME, PSNET_SAME, psnet_combine_i32)
PSNET_REDUCE(psnet_reduce_i64, long long, long long, PSNET_SAME, PSNET_SAME, psnet_combine_i64)
PSNET_REDUCE(psnet_reduce_u8, psnet_u8, psnet_u8, PSNET_SAME, PSNET_SAME, psnet_combine_u8)

extern "C" __global__ void psnet_divide_f32(float* dst, psnet_u64 n, float divisor) {
    PSNET_EACH(i, n) dst[i] = __fdiv_rn(dst[i], divisor);
}

extern "C" __global__ void psnet_divide_f64(double* dst, psnet_u64 n, double divisor) {
    PSNET_EACH(i, n) dst[i] = __ddiv_rn(dst[i], divisor);
}

extern "C" __global__ void psnet_divide_f16(psnet_u16* dst, psnet_u64 n, psnet_u16 divisor) {
    float d = psnet_f16_to_f32(divisor);
    PSNET_EACH(i, n) dst[i] = psnet_f32_to_f16(__fdiv_rn(psnet_f16_to_f32(dst[i]), d));
}

extern "C" __global__ void psnet_divide_bf16(psnet_u16* dst, psnet_u64 n, psnet_u16 divisor) {
    float d = psnet_bf16_to_f32(divisor);
    PSNET_EACH(i, n) dst[i] = psnet_f32_to_bf16(__fdiv_rn(psnet_bf16_to_f32(dst[i]), d));
}
"#;
