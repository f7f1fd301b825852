//! The CUDA kernels' own source ([`KERNELS_SRC`]) run on the CPU: compiled as C++ with a
//! small emulation of what they use of CUDA (thread and block indices, `float4`, `__fadd_rn`,
//! `__shfl_down_sync`), and launched over a grid the caller chooses, every thread of a warp
//! in a thread of its own so that shuffles exchange values as on a GPU. Floating point is
//! IEEE single precision without contraction (`-ffp-contract=off`), as the kernels are
//! compiled by NVRTC (`--fmad=false --ftz=false`).
//!
//! This checks the kernels' logic (indices, the vector and scalar paths, padding, grid-stride
//! loops, the warp shuffle joining 1-bit nibbles) where no GPU is; it cannot see what only a
//! GPU does (memory ordering between threads, occupancy, speed).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use psnet_compression::cuda::KERNELS_SRC;

#[path = "cxx.rs"]
mod cxx;

/// What the kernels use of CUDA, for a C++ compiler.
const PRELUDE: &str = r#"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define __global__
#define __device__
#define __forceinline__ inline

struct psnet_dim3 { unsigned int x, y, z; };
static __thread psnet_dim3 threadIdx, blockIdx;
static psnet_dim3 blockDim, gridDim;

struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
static inline float4 make_float4(float x, float y, float z, float w) {
    float4 v = {x, y, z, w};
    return v;
}
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }

/* One warp's lanes meet at every shuffle; a lane that has left the kernel while others wait
   at one (a shuffle a GPU would leave undefined) ends the run with an error. */
struct psnet_warp {
    pthread_mutex_t m;
    pthread_cond_t c;
    unsigned int arrived, exited, generation;
    unsigned int slot[32];
};
static __thread psnet_warp* psnet_my_warp;
static __thread unsigned int psnet_my_lane;

static void psnet_diverged() {
    fprintf(stderr, "a shuffle was reached with lanes of its warp gone\n");
    exit(3);
}

static void psnet_warp_meet(psnet_warp* w) {
    pthread_mutex_lock(&w->m);
    if (w->exited) psnet_diverged();
    unsigned int gen = w->generation;
    if (++w->arrived == 32) {
        w->arrived = 0;
        w->generation++;
        pthread_cond_broadcast(&w->c);
    } else {
        while (gen == w->generation) {
            if (w->exited) psnet_diverged();
            pthread_cond_wait(&w->c, &w->m);
        }
    }
    pthread_mutex_unlock(&w->m);
}

static unsigned int __shfl_down_sync(unsigned int mask, unsigned int v, unsigned int delta) {
    psnet_warp* w = psnet_my_warp;
    if (!w || mask != 0xffffffffu) {
        fprintf(stderr, "__shfl_down_sync outside a full warp\n");
        exit(3);
    }
    w->slot[psnet_my_lane] = v;
    psnet_warp_meet(w);
    unsigned int src = psnet_my_lane + delta;
    unsigned int r = src < 32 ? w->slot[src] : v;
    psnet_warp_meet(w);
    return r;
}
"#;

/// Reads one launch from stdin, runs it, writes the buffers back to stdout.
const DRIVER: &str = r#"
typedef void (*psnet_kernel_fn)(void*);

struct psnet_launch {
    unsigned int kernel, blocks, threads, misalign;
    unsigned long long n, out_len;
    float a, b;
    int add;
    float *grad, *residual, *out;
    unsigned char* bytes;
};

static void psnet_run_kernel(psnet_launch* l) {
    switch (l->kernel) {
    case 0: psnet_quantize_2bit(l->grad, l->residual, l->bytes, l->n, l->out_len, l->a, l->b); break;
    case 1: psnet_quantize_1bit(l->grad, l->residual, l->bytes, l->n, l->out_len, l->a); break;
    case 2: psnet_dequantize_2bit(l->bytes, l->out, l->n, l->a, l->b, l->add); break;
    case 3: psnet_dequantize_1bit(l->bytes, l->out, l->n, l->add); break;
    default: fprintf(stderr, "no kernel %u\n", l->kernel); exit(2);
    }
}

struct psnet_lane_args { psnet_launch* l; psnet_warp* w; unsigned int block, thread; };

static void* psnet_lane_main(void* p) {
    psnet_lane_args* a = (psnet_lane_args*)p;
    blockIdx.x = a->block; blockIdx.y = 0; blockIdx.z = 0;
    threadIdx.x = a->thread; threadIdx.y = 0; threadIdx.z = 0;
    psnet_my_warp = a->w;
    psnet_my_lane = a->thread & 31u;
    psnet_run_kernel(a->l);
    pthread_mutex_lock(&a->w->m);
    a->w->exited++;
    if (a->w->arrived) psnet_diverged();
    pthread_cond_broadcast(&a->w->c);
    pthread_mutex_unlock(&a->w->m);
    return 0;
}

static void psnet_read(void* dst, size_t len) {
    if (len && fread(dst, 1, len, stdin) != len) { fprintf(stderr, "short input\n"); exit(2); }
}
static void psnet_write(const void* src, size_t len) {
    if (len && fwrite(src, 1, len, stdout) != len) { fprintf(stderr, "short output\n"); exit(2); }
}

/* A float buffer of n elements starting `misalign` floats after a 16-byte boundary. */
static float* psnet_floats(size_t n, unsigned int misalign) {
    float* base = (float*)aligned_alloc(16, ((n + misalign) * 4 + 16) & ~(size_t)15);
    if (!base) exit(2);
    return base + misalign;
}

int main() {
    psnet_launch l;
    psnet_read(&l.kernel, 4); psnet_read(&l.blocks, 4); psnet_read(&l.threads, 4);
    psnet_read(&l.misalign, 4); psnet_read(&l.n, 8); psnet_read(&l.out_len, 8);
    psnet_read(&l.a, 4); psnet_read(&l.b, 4); psnet_read(&l.add, 4);
    if (l.threads == 0 || l.threads % 32 || l.blocks == 0 || l.misalign > 3) {
        fprintf(stderr, "bad launch\n");
        return 2;
    }
    l.grad = psnet_floats(l.n, l.misalign);
    l.residual = psnet_floats(l.n, l.misalign);
    l.out = psnet_floats(l.n, l.misalign);
    l.bytes = (unsigned char*)malloc(l.out_len + 1);
    psnet_read(l.grad, l.n * 4); psnet_read(l.residual, l.n * 4);
    psnet_read(l.bytes, l.out_len); psnet_read(l.out, l.n * 4);
    gridDim.x = l.blocks; gridDim.y = 1; gridDim.z = 1;
    blockDim.x = l.threads; blockDim.y = 1; blockDim.z = 1;
    psnet_lane_args args[32];
    pthread_t lanes[32];
    for (unsigned int b = 0; b < l.blocks; ++b) {
        for (unsigned int w0 = 0; w0 < l.threads; w0 += 32) {
            psnet_warp warp;
            memset(&warp, 0, sizeof warp);
            pthread_mutex_init(&warp.m, 0);
            pthread_cond_init(&warp.c, 0);
            for (unsigned int t = 0; t < 32; ++t) {
                args[t].l = &l; args[t].w = &warp; args[t].block = b; args[t].thread = w0 + t;
                if (pthread_create(&lanes[t], 0, psnet_lane_main, &args[t])) exit(2);
            }
            for (unsigned int t = 0; t < 32; ++t) pthread_join(lanes[t], 0);
        }
    }
    psnet_write(l.residual, l.n * 4);
    psnet_write(l.bytes, l.out_len);
    psnet_write(l.out, l.n * 4);
    return 0;
}
"#;

/// One of the four kernels.
#[derive(Clone, Copy, Debug)]
pub enum Kernel {
    /// `psnet_quantize_2bit(grad, residual, out, n, out_len, pos, neg)`.
    Quantize2,
    /// `psnet_quantize_1bit(grad, residual, out, n, out_len, threshold)`.
    Quantize1,
    /// `psnet_dequantize_2bit(in, out, n, pos, neg, add)`.
    Dequantize2,
    /// `psnet_dequantize_1bit(in, out, n, add)`.
    Dequantize1,
}

/// A launch: the grid, how far the float buffers sit from a 16-byte boundary (in floats: 0
/// takes the vector path, 1-3 the scalar one) and the kernel's inputs.
#[derive(Clone, Debug)]
pub struct Launch {
    pub kernel: Kernel,
    pub blocks: u32,
    pub threads: u32,
    pub misalign: u32,
    /// Thresholds: (pos, neg) for 2-bit quantize and dequantize, (threshold, unused) for 1-bit
    /// quantize.
    pub a: f32,
    pub b: f32,
    pub add: bool,
    pub grad: Vec<f32>,
    pub residual: Vec<f32>,
    /// The compressed bytes: the quantize's output buffer (its old contents), the
    /// dequantize's input. Its length is the kernels' `out_len`.
    pub bytes: Vec<u8>,
    /// The dequantize's output buffer (its old contents; the same length as `grad`).
    pub out: Vec<f32>,
}

/// The buffers after a launch.
#[derive(Debug)]
pub struct Result {
    pub residual: Vec<f32>,
    pub bytes: Vec<u8>,
    pub out: Vec<f32>,
}

/// The emulator's executable, built once per test process; `Err` says why it cannot be
/// (no C++ compiler).
fn emulator() -> &'static std::result::Result<PathBuf, String> {
    static EXE: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    EXE.get_or_init(|| cxx::build("kernel-emu", &format!("{PRELUDE}\n{KERNELS_SRC}\n{DRIVER}")))
}

/// Whether the emulator can run here; prints why not (`test` names the skipped test).
pub fn available(test: &str) -> bool {
    match emulator() {
        Ok(_) => true,
        Err(why) => {
            eprintln!("{test}: skipped: {why}");
            false
        }
    }
}

/// Runs `launch` on the emulator (which must be [`available`]).
pub fn run(launch: &Launch) -> Result {
    let exe = emulator().as_ref().expect("the emulator is available");
    let n = launch.grad.len();
    assert_eq!(launch.residual.len(), n);
    assert_eq!(launch.out.len(), n);
    let mut input = Vec::new();
    let kernel = launch.kernel as u32;
    for v in [kernel, launch.blocks, launch.threads, launch.misalign] {
        input.extend_from_slice(&v.to_le_bytes());
    }
    input.extend_from_slice(&(n as u64).to_le_bytes());
    input.extend_from_slice(&(launch.bytes.len() as u64).to_le_bytes());
    input.extend_from_slice(&launch.a.to_le_bytes());
    input.extend_from_slice(&launch.b.to_le_bytes());
    input.extend_from_slice(&i32::from(launch.add).to_le_bytes());
    for v in launch.grad.iter().chain(&launch.residual) {
        input.extend_from_slice(&v.to_le_bytes());
    }
    input.extend_from_slice(&launch.bytes);
    for v in &launch.out {
        input.extend_from_slice(&v.to_le_bytes());
    }
    let mut child = Command::new(exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the emulator starts");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(&input)
        .expect("the launch is written");
    let out = child.wait_with_output().expect("the emulator runs");
    assert!(
        out.status.success(),
        "{:?} n={n} grid {}x{}: {}",
        launch.kernel,
        launch.blocks,
        launch.threads,
        String::from_utf8_lossy(&out.stderr)
    );
    let floats = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let s = out.stdout;
    assert_eq!(
        s.len(),
        8 * n + launch.bytes.len(),
        "emulator output length"
    );
    Result {
        residual: floats(&s[..4 * n]),
        bytes: s[4 * n..4 * n + launch.bytes.len()].to_vec(),
        out: floats(&s[4 * n + launch.bytes.len()..]),
    }
}
