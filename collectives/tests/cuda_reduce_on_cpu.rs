//! The reduction kernels that allreduces of GPU buffers run (`REDUCE_KERNELS_SRC`), compiled
//! as C++ and run on the CPU, against the host path's own operations: for every element type
//! and operation, both operand orders, copies and the averages' division, every result bit
//! the same. Half-precision types run every one of their 65,536 bit patterns (zeros, NaNs,
//! infinities, subnormals), so the kernels' own conversions to and from `f32` are checked
//! against the `half` crate's (F16C where the CPU has it) that the host path uses. Grids from
//! one warp to several blocks make the grid-stride loops turn. Where a GPU is, `tests/gpu.rs`
//! runs the same kernels for real; this runs wherever a C++ compiler is, and says why it
//! skipped where none is. It cannot see what only a GPU does: the GPU's canonical NaN from
//! arithmetic, memory ordering, speed.
#![cfg(feature = "cuda")]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use half::slice::HalfFloatSliceExt;
use psnet_collectives::{bf16, f16, Element};
use psnet_compression::cuda::{Combine, DeviceElement, REDUCE_KERNELS_SRC};

#[path = "../../compression/tests/common/cxx.rs"]
mod cxx;

/// What the kernels use of CUDA, for a C++ compiler: thread indices and rounded arithmetic
/// (plain IEEE operations without contraction).
const PRELUDE: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define __global__
#define __device__
#define __forceinline__ inline

struct psnet_dim3 { unsigned int x, y, z; };
static psnet_dim3 threadIdx, blockIdx, blockDim, gridDim;

static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
"#;

/// Reads one launch from stdin, runs every thread of the grid in turn (the kernels share
/// nothing between threads), writes `dst` back.
const DRIVER: &str = r#"
static void psnet_read(void* dst, size_t len) {
    if (len && fread(dst, 1, len, stdin) != len) { fprintf(stderr, "short input\n"); exit(2); }
}

int main() {
    unsigned int kind, op, remote_first, blocks, threads;
    unsigned long long n, divisor;
    psnet_read(&kind, 4); psnet_read(&op, 4); psnet_read(&remote_first, 4);
    psnet_read(&blocks, 4); psnet_read(&threads, 4);
    psnet_read(&n, 8); psnet_read(&divisor, 8);
    static const size_t sizes[7] = {4, 8, 2, 2, 4, 8, 1};
    if (kind > 6 || op > 5 || blocks == 0 || threads == 0) { fprintf(stderr, "bad launch\n"); return 2; }
    size_t bytes = n * sizes[kind];
    void* dst = aligned_alloc(16, (bytes + 16) & ~(size_t)15);
    void* src = aligned_alloc(16, (bytes + 16) & ~(size_t)15);
    if (!dst || !src) return 2;
    psnet_read(dst, bytes); psnet_read(src, bytes);
    gridDim.x = blocks; gridDim.y = 1; gridDim.z = 1;
    blockDim.x = threads; blockDim.y = 1; blockDim.z = 1;
    float f32_div; double f64_div; unsigned short half_div = (unsigned short)divisor;
    unsigned int low = (unsigned int)divisor;
    memcpy(&f32_div, &low, 4); memcpy(&f64_div, &divisor, 8);
    for (unsigned int b = 0; b < blocks; ++b) {
        for (unsigned int t = 0; t < threads; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            int o = (int)op, r = (int)remote_first;
            if (op == 5) {
                switch (kind) {
                case 0: psnet_divide_f32((float*)dst, n, f32_div); break;
                case 1: psnet_divide_f64((double*)dst, n, f64_div); break;
                case 2: psnet_divide_f16((psnet_u16*)dst, n, half_div); break;
                case 3: psnet_divide_bf16((psnet_u16*)dst, n, half_div); break;
                default: fprintf(stderr, "no divide for kind %u\n", kind); return 2;
                }
                continue;
            }
            switch (kind) {
            case 0: psnet_reduce_f32((float*)dst, (const float*)src, n, o, r); break;
            case 1: psnet_reduce_f64((double*)dst, (const double*)src, n, o, r); break;
            case 2: psnet_reduce_f16((psnet_u16*)dst, (const psnet_u16*)src, n, o, r); break;
            case 3: psnet_reduce_bf16((psnet_u16*)dst, (const psnet_u16*)src, n, o, r); break;
            case 4: psnet_reduce_i32((int*)dst, (const int*)src, n, o, r); break;
            case 5: psnet_reduce_i64((long long*)dst, (const long long*)src, n, o, r); break;
            case 6: psnet_reduce_u8((psnet_u8*)dst, (const psnet_u8*)src, n, o, r); break;
            }
        }
    }
    if (bytes && fwrite(dst, 1, bytes, stdout) != bytes) return 2;
    return 0;
}
"#;

fn emulator() -> &'static Result<PathBuf, String> {
    static EXE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    EXE.get_or_init(|| {
        cxx::build(
            "reduce-emu",
            &format!("{PRELUDE}\n{REDUCE_KERNELS_SRC}\n{DRIVER}"),
        )
    })
}

fn available(test: &str) -> bool {
    match emulator() {
        Ok(_) => true,
        Err(why) => {
            eprintln!("{test}: skipped: {why}");
            false
        }
    }
}

/// Grids: one warp; three blocks of two warps; two blocks of 256 threads.
const GRIDS: [(u32, u32); 3] = [(1, 32), (3, 64), (2, 256)];

/// What to run: `op` 0-4 is a [`Combine`], 5 the divide by the element whose bits are
/// `divisor`.
struct Launch<'a> {
    kind: DeviceElement,
    op: u32,
    remote_first: bool,
    grid: (u32, u32),
    divisor: u64,
    dst: &'a [u8],
    src: &'a [u8],
}

fn run(l: &Launch<'_>) -> Vec<u8> {
    let exe = emulator().as_ref().expect("the emulator is available");
    let kind = DeviceElement::ALL
        .iter()
        .position(|&k| k == l.kind)
        .unwrap() as u32;
    let n = (l.dst.len() / l.kind.size()) as u64;
    let mut input = Vec::with_capacity(36 + 2 * l.dst.len());
    for v in [kind, l.op, u32::from(l.remote_first), l.grid.0, l.grid.1] {
        input.extend_from_slice(&v.to_le_bytes());
    }
    input.extend_from_slice(&n.to_le_bytes());
    input.extend_from_slice(&l.divisor.to_le_bytes());
    input.extend_from_slice(l.dst);
    input.extend_from_slice(l.src);
    let mut child = Command::new(exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the emulator starts");
    let mut stdin = child.stdin.take().expect("stdin");
    // Written from a thread of its own: the emulator's output may fill its pipe first.
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().expect("the emulator runs");
    writer.join().unwrap().expect("the launch is written");
    assert!(
        out.status.success(),
        "{:?} op {}: {}",
        l.kind,
        l.op,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout.len(), l.dst.len(), "emulator output length");
    out.stdout
}

/// Elements read out of bytes at any alignment.
fn elems<E: bytemuck::Pod>(bytes: &[u8]) -> Vec<E> {
    bytes
        .chunks_exact(std::mem::size_of::<E>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

/// A deterministic stream of bytes (splitmix64).
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The host path's `op(a, b)` for elements of `E` (what `reduce_bytes` does per element).
fn host_op<E: Element>(op: Combine) -> fn(E, E) -> E {
    match op {
        Combine::Sum => E::add,
        Combine::Prod => E::mul,
        Combine::Min => E::min,
        Combine::Max => E::max,
        Combine::Copy => |_, b| b,
    }
}

/// The host path on plain element types: `dst = op(dst, src)` or `op(src, dst)`.
fn model<E: Element>(op: Combine, remote_first: bool, dst: &[u8], src: &[u8]) -> Vec<u8> {
    let d: Vec<E> = elems(dst);
    let s: Vec<E> = elems(src);
    let f = host_op::<E>(op);
    let out: Vec<E> = d
        .iter()
        .zip(&s)
        .map(|(&d, &s)| match (op, remote_first) {
            (Combine::Copy, _) => s,
            (_, false) => f(d, s),
            (_, true) => f(s, d),
        })
        .collect();
    bytemuck::cast_slice(&out).to_vec()
}

/// The host path on half-precision types: whole slices widened to `f32` (F16C where the CPU
/// has it), combined there, narrowed back.
fn model_half<H>(op: Combine, remote_first: bool, dst: &[u8], src: &[u8]) -> Vec<u8>
where
    H: bytemuck::Pod,
    [H]: HalfFloatSliceExt,
{
    if op == Combine::Copy {
        return src.to_vec();
    }
    let d: Vec<H> = elems(dst);
    let s: Vec<H> = elems(src);
    let (mut wd, mut ws) = (vec![0f32; d.len()], vec![0f32; s.len()]);
    d.convert_to_f32_slice(&mut wd);
    s.convert_to_f32_slice(&mut ws);
    let f = host_op::<f32>(op);
    for (d, &s) in wd.iter_mut().zip(&ws) {
        *d = if remote_first { f(s, *d) } else { f(*d, s) };
    }
    let mut out = d;
    out.convert_from_f32_slice(&wd);
    bytemuck::cast_slice(&out).to_vec()
}

fn expected(kind: DeviceElement, op: Combine, remote_first: bool, d: &[u8], s: &[u8]) -> Vec<u8> {
    match kind {
        DeviceElement::F32 => model::<f32>(op, remote_first, d, s),
        DeviceElement::F64 => model::<f64>(op, remote_first, d, s),
        DeviceElement::F16 => model_half::<f16>(op, remote_first, d, s),
        DeviceElement::BF16 => model_half::<bf16>(op, remote_first, d, s),
        DeviceElement::I32 => model::<i32>(op, remote_first, d, s),
        DeviceElement::I64 => model::<i64>(op, remote_first, d, s),
        DeviceElement::U8 => model::<u8>(op, remote_first, d, s),
    }
}

/// Operands for `kind`: for half types, every bit pattern against random ones, against
/// itself and against its neighbours (sums and products that round at every place, ties
/// included); for the others random bits plus small integers' values (exact sums, equal
/// operands for min and max), in buffers whose length is no multiple of any grid.
fn operands(kind: DeviceElement) -> (Vec<u8>, Vec<u8>) {
    match kind {
        DeviceElement::F16 | DeviceElement::BF16 => {
            let all: Vec<u16> = (0..=u16::MAX).collect();
            let random: Vec<u16> = elems(&random_bytes(1 << 17, 7));
            let mut dst = Vec::new();
            let mut src = Vec::new();
            for partner in [random, all.clone(), all.iter().map(|x| x ^ 1).collect()] {
                dst.extend_from_slice(&all);
                src.extend(partner);
            }
            dst.push(0x3c00);
            src.push(0x3c00);
            (
                bytemuck::cast_slice(&dst).to_vec(),
                bytemuck::cast_slice(&src).to_vec(),
            )
        }
        _ => {
            let n = 40_003 * kind.size();
            let mut dst = random_bytes(n, 1);
            let mut src = random_bytes(n, 2);
            // The second half: small values, equal in places.
            let half = n / 2 / kind.size() * kind.size();
            let small: Vec<u8> = (0..(n - half) / kind.size())
                .flat_map(|i| small_value(kind, i as i64 % 7 - 3))
                .collect();
            dst[half..].copy_from_slice(&small);
            let small: Vec<u8> = (0..(n - half) / kind.size())
                .flat_map(|i| small_value(kind, i as i64 % 5 - 2))
                .collect();
            src[half..].copy_from_slice(&small);
            (dst, src)
        }
    }
}

fn small_value(kind: DeviceElement, v: i64) -> Vec<u8> {
    match kind {
        DeviceElement::F32 => (v as f32 * 0.75).to_le_bytes().to_vec(),
        DeviceElement::F64 => (v as f64 * 0.75).to_le_bytes().to_vec(),
        DeviceElement::I32 => (v as i32).to_le_bytes().to_vec(),
        DeviceElement::I64 => v.to_le_bytes().to_vec(),
        DeviceElement::U8 => vec![v as u8],
        DeviceElement::F16 | DeviceElement::BF16 => unreachable!("every pattern is run"),
    }
}

const COMBINES: [Combine; 5] = [
    Combine::Sum,
    Combine::Prod,
    Combine::Min,
    Combine::Max,
    Combine::Copy,
];

/// Whether `bytes` (one element of `kind`) is a NaN.
fn is_nan(kind: DeviceElement, bytes: &[u8]) -> bool {
    let mut b = [0u8; 8];
    b[..bytes.len()].copy_from_slice(bytes);
    let bits = u64::from_le_bytes(b);
    match kind {
        DeviceElement::F32 => bits & 0x7fff_ffff > 0x7f80_0000,
        DeviceElement::F64 => bits & 0x7fff_ffff_ffff_ffff > 0x7ff0_0000_0000_0000,
        DeviceElement::F16 => bits & 0x7fff > 0x7c00,
        DeviceElement::BF16 => bits & 0x7fff > 0x7f80,
        _ => false,
    }
}

/// The first element where the kernel and the host differ. Where arithmetic (`arith`) made
/// a NaN, both being NaN is enough: which operand's payload survives is the compiler's
/// choice here (it may swap a sum's operands) and the GPU's canonical NaN there; NaNs that a
/// selection (min, max, copy) or a conversion yields must match bit for bit.
fn first_difference(kind: DeviceElement, arith: bool, got: &[u8], want: &[u8]) -> Option<String> {
    let size = kind.size();
    got.chunks(size)
        .zip(want.chunks(size))
        .position(|(g, w)| g != w && !(arith && is_nan(kind, g) && is_nan(kind, w)))
        .map(|i| {
            format!(
                "element {i}: kernel {:02x?}, host {:02x?}",
                &got[i * size..(i + 1) * size],
                &want[i * size..(i + 1) * size]
            )
        })
}

#[test]
fn every_type_and_operation_reduces_to_the_host_paths_bits_in_both_orders() {
    if !available("reduction kernels on the CPU") {
        return;
    }
    for kind in DeviceElement::ALL {
        let (dst, src) = operands(kind);
        for (i, op) in COMBINES.into_iter().enumerate() {
            for remote_first in [false, true] {
                // Every grid for sums; one each for the rest (the loop is the same code).
                let grids = if op == Combine::Sum {
                    &GRIDS[..]
                } else {
                    &GRIDS[(i + usize::from(remote_first)) % 3..][..1]
                };
                let want = expected(kind, op, remote_first, &dst, &src);
                for &grid in grids {
                    let got = run(&Launch {
                        kind,
                        op: op as u32,
                        remote_first,
                        grid,
                        divisor: 0,
                        dst: &dst,
                        src: &src,
                    });
                    let arith = matches!(op, Combine::Sum | Combine::Prod);
                    if let Some(diff) = first_difference(kind, arith, &got, &want) {
                        panic!("{kind:?} {op:?} remote_first={remote_first} grid {grid:?}: {diff}");
                    }
                }
            }
        }
    }
}

/// The divisor's bits as `allreduce_device` passes them: the host's own `n` in the type.
fn divisor_bits(kind: DeviceElement, n: usize) -> u64 {
    match kind {
        DeviceElement::F32 => u64::from((n as f32).to_bits()),
        DeviceElement::F64 => (n as f64).to_bits(),
        DeviceElement::F16 => u64::from(f16::from_f64(n as f64).to_bits()),
        DeviceElement::BF16 => u64::from(bf16::from_f64(n as f64).to_bits()),
        _ => unreachable!("integers are not averaged"),
    }
}

fn host_divide<E: Element>(buf: &[u8], n: usize) -> Vec<u8> {
    let v: Vec<E> = elems(buf);
    let out: Vec<E> = v.into_iter().map(|x| x.div_count(n)).collect();
    bytemuck::cast_slice(&out).to_vec()
}

#[test]
fn averages_divide_to_the_host_paths_bits() {
    if !available("reduction kernels on the CPU") {
        return;
    }
    for kind in DeviceElement::ALL.into_iter().filter(|k| k.is_float()) {
        let (dst, _) = operands(kind);
        for (ranks, grid) in [(2, GRIDS[0]), (3, GRIDS[1]), (7, GRIDS[2]), (12, GRIDS[0])] {
            let got = run(&Launch {
                kind,
                op: 5,
                remote_first: false,
                grid,
                divisor: divisor_bits(kind, ranks),
                dst: &dst,
                src: &dst,
            });
            let want = match kind {
                DeviceElement::F32 => host_divide::<f32>(&dst, ranks),
                DeviceElement::F64 => host_divide::<f64>(&dst, ranks),
                DeviceElement::F16 => host_divide::<f16>(&dst, ranks),
                _ => host_divide::<bf16>(&dst, ranks),
            };
            if let Some(diff) = first_difference(kind, true, &got, &want) {
                panic!("{kind:?} divided by {ranks}: {diff}");
            }
        }
    }
}
