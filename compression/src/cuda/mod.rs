//! CUDA kernels for 2-bit and 1-bit compression (feature `cuda`).
//!
//! The kernels ([`KERNELS_SRC`]) are compiled at run time with NVRTC and loaded through the
//! CUDA driver API; cudarc loads `libcuda` and `libnvrtc` dynamically, so the crate builds
//! without any CUDA installation. [`CudaCompressor::new`] checks that the libraries and a
//! device are present *before* touching cudarc (which panics when a library is missing) and
//! otherwise returns [`CompressionError::NoCudaDevice`] with the reason.
//!
//! # Bit-exactness
//! The kernels perform the CPU operations with explicitly rounded intrinsics (`__fadd_rn`,
//! `__fsub_rn`) and are compiled with `--fmad=false --ftz=false`, so compressed bytes and
//! finite / infinite residuals are identical to the CPU path. One difference: a NaN produced
//! by GPU arithmetic is the canonical NaN, whereas x86 propagates the input NaN's payload, so
//! NaN residuals are NaN on both but may differ in their bits.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr,
    LaunchConfig, PinnedHostSlice, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use crate::compressor::Scheme;
use crate::error::{CompressionError, ParamsError};
use crate::params::CompressionParams;
use crate::{one_bit, two_bit};

mod borrowed;
mod grid;
mod kernels;
mod landing;
pub mod measure;
mod reduce;
mod reduce_kernels;
mod staging;

use grid::{grid_stride, max_blocks};

pub use borrowed::BorrowedDevice;
pub use kernels::KERNELS_SRC;
pub use landing::{CudaLanding, CudaLandings};
pub use reduce::{split_view_mut, Combine, CudaReducer, DeviceElement};
pub use reduce_kernels::REDUCE_KERNELS_SRC;
pub use staging::{CudaBytes, CudaStager, WaitOnDrop};

const THREADS_PER_BLOCK: u32 = 256;
/// Resident blocks per multiprocessor asked for (2048 threads: a full H100 or A100 SM).
const BLOCKS_PER_SM: u32 = 8;
/// Elements each thread handles per loop turn (one `float4`).
const ELEMS_PER_THREAD: u64 = 4;

/// Number of CUDA devices, or [`CompressionError::NoCudaDevice`] saying why there are none
/// usable (driver library missing, `cuInit` failure, zero devices). Never panics.
pub fn device_count() -> Result<usize, CompressionError> {
    // SAFETY: only tries to dlopen the driver library under its usual names (and closes it);
    // no symbol of it is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CompressionError::NoCudaDevice(
            "the CUDA driver library (libcuda) was not found: no NVIDIA driver is installed".into(),
        ));
    }
    let count = guard(CudaContext::device_count)
        .map_err(|e| CompressionError::NoCudaDevice(format!("cuInit / cuDeviceGetCount: {e}")))?;
    match usize::try_from(count) {
        Ok(0) | Err(_) => Err(CompressionError::NoCudaDevice(
            "the CUDA driver reports no device".into(),
        )),
        Ok(count) => Ok(count),
    }
}

/// The cudarc this crate was built with, for callers that allocate the buffers it takes.
pub use cudarc;

/// Runs a cudarc call, turning its error and any panic of the bindings into
/// [`CompressionError::Cuda`] naming `what`.
pub fn guarded<T, E: std::fmt::Display>(
    what: &str,
    f: impl FnOnce() -> Result<T, E>,
) -> Result<T, CompressionError> {
    guard(f).map_err(cuda_err(what))
}

/// The primary context of device `ordinal` (the same value on every call), or
/// [`CompressionError::NoCudaDevice`] saying why there is none; never panics.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>, CompressionError> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(CompressionError::NoCudaDevice(format!(
            "device {ordinal} requested but only {count} present"
        )));
    }
    // One per device for the whole process: cudarc keeps its per-context state (how many
    // streams exist, so whether buffers carry events that order streams; errors raised in
    // destructors) in each `CudaContext` value, and its first stream synchronizes the whole
    // device. Every part of psnet (compressors, stagers, reducers, borrowed memory) shares it.
    static CONTEXTS: Mutex<Vec<Option<Arc<CudaContext>>>> = Mutex::new(Vec::new());
    let mut contexts = CONTEXTS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(Some(ctx)) = contexts.get(ordinal) {
        return Ok(ctx.clone());
    }
    let ctx = guarded("creating the context", || CudaContext::new(ordinal))?;
    if contexts.len() <= ordinal {
        contexts.resize(ordinal + 1, None);
    }
    contexts[ordinal] = Some(ctx.clone());
    Ok(ctx)
}

/// `len` zeroed elements of page-locked host memory on `ctx`, for copies to and from the
/// device at full PCIe speed. Plain (not write-combined) memory: the CPU reads it to send it.
pub fn pinned_zeroed<T: DeviceRepr + ValidAsZeroBits>(
    ctx: &Arc<CudaContext>,
    len: usize,
) -> Result<PinnedHostSlice<T>, CompressionError> {
    // SAFETY: the allocation's contents are unset; they are zeroed below before anything
    // reads them, and all-zero bits are a valid `T` (`ValidAsZeroBits`).
    let mut slice = guarded("allocating pinned host memory", || unsafe {
        ctx.alloc_pinned_with_flags::<T>(len, 0)
    })?;
    let ptr = guarded("pinned host memory", || slice.as_mut_ptr())?;
    // SAFETY: `ptr` is the start of the allocation of `len` elements made above, exclusively
    // ours (`slice` is borrowed mutably and nothing else has seen it).
    unsafe { std::ptr::write_bytes(ptr, 0, len) };
    Ok(slice)
}

/// Runs a cudarc call, turning both its errors and its panics into a message.
fn guard<T, E: std::fmt::Display>(f: impl FnOnce() -> Result<T, E>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(e.to_string()),
        Err(panic) => Err(panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "panic in the CUDA bindings".into())),
    }
}

fn cuda_err(what: &str) -> impl Fn(String) -> CompressionError + '_ {
    move |e| CompressionError::Cuda(format!("{what}: {e}"))
}

/// Whether NVRTC can be loaded (it needs no GPU: the kernels compile without one).
fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen libnvrtc under its usual names; calls none of it.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles `src` (named `name` in NVRTC's messages) for `arch` (NVRTC's default when
/// `None`) with the options the kernels' bit-exactness rests on: no fused multiply-add, no
/// flushing of denormals to zero, IEEE division and square root. NVRTC must be present
/// ([`nvrtc_present`]).
fn compile_source(src: &str, name: &str, arch: Option<&'static str>) -> Result<Ptx, String> {
    let opts = CompileOptions {
        ftz: Some(false),
        fmad: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        arch,
        name: Some(name.into()),
        ..Default::default()
    };
    guard(|| compile_ptx_with_opts(src, opts)).map_err(|e| format!("NVRTC: {e}"))
}

/// `src` compiled once per process into `cell`; [`CompressionError::NoCudaDevice`] without
/// NVRTC.
fn ptx_once(
    cell: &'static OnceLock<Result<Ptx, String>>,
    src: &str,
    name: &str,
) -> Result<Ptx, CompressionError> {
    cell.get_or_init(|| {
        if !nvrtc_present() {
            return Err("libnvrtc (the CUDA runtime compiler) was not found".into());
        }
        compile_source(src, name, None)
    })
    .clone()
    .map_err(CompressionError::NoCudaDevice)
}

/// The kernels compiled once per process.
fn ptx() -> Result<Ptx, CompressionError> {
    static PTX: OnceLock<Result<Ptx, String>> = OnceLock::new();
    ptx_once(&PTX, KERNELS_SRC, "psnet_compression.cu")
}

/// Quantize / dequantize on device buffers, bit-compatible with the CPU compressors.
///
/// Work is queued on the compressor's [`stream`](Self::stream) (the device's default stream);
/// device buffers must belong to the same device. The `*_host` methods copy host slices in
/// and out for convenience (and tests).
#[derive(Debug)]
pub struct CudaCompressor {
    scheme: Scheme,
    threshold: f32,
    stream: Arc<CudaStream>,
    quantize: CudaFunction,
    dequantize: CudaFunction,
    /// Largest grid launched: enough blocks to fill every multiprocessor; grid-stride loops
    /// cover the rest.
    max_blocks: u32,
}

impl CudaCompressor {
    /// A compressor on device `ordinal` for `params` (which must not be `none`).
    ///
    /// Returns [`CompressionError::NoCudaDevice`] when there is no driver, no device, no
    /// device `ordinal`, or no NVRTC library; never panics.
    pub fn new(ordinal: usize, params: &CompressionParams) -> Result<Self, CompressionError> {
        let (scheme, threshold) = match *params {
            CompressionParams::None => {
                return Err(ParamsError::Malformed(
                    "a CUDA compressor needs \"2bit\" or \"1bit\", not \"none\"".into(),
                )
                .into())
            }
            CompressionParams::TwoBit { threshold } => {
                (Scheme::TwoBit, two_bit::validate_threshold(threshold)?)
            }
            CompressionParams::OneBit { threshold } => {
                (Scheme::OneBit, one_bit::validate_threshold(threshold)?)
            }
        };
        let ctx = context(ordinal)?;
        let ptx = ptx()?;
        let stream = ctx.default_stream();
        let max_blocks = max_blocks(&ctx)?;
        let module = guard(|| ctx.load_module(ptx)).map_err(cuda_err("loading the kernels"))?;
        let (q, d) = match scheme {
            Scheme::TwoBit => ("psnet_quantize_2bit", "psnet_dequantize_2bit"),
            Scheme::OneBit => ("psnet_quantize_1bit", "psnet_dequantize_1bit"),
        };
        let quantize = guard(|| module.load_function(q)).map_err(cuda_err(q))?;
        let dequantize = guard(|| module.load_function(d)).map_err(cuda_err(d))?;
        Ok(CudaCompressor {
            scheme,
            threshold,
            stream,
            quantize,
            dequantize,
            max_blocks,
        })
    }

    /// A 2-bit compressor on device `ordinal`.
    pub fn two_bit(ordinal: usize, threshold: f32) -> Result<Self, CompressionError> {
        Self::new(ordinal, &CompressionParams::two_bit(threshold)?)
    }

    /// A 1-bit compressor on device `ordinal`.
    pub fn one_bit(ordinal: usize, threshold: f32) -> Result<Self, CompressionError> {
        Self::new(ordinal, &CompressionParams::one_bit(threshold)?)
    }

    /// The scheme.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// The threshold.
    pub fn threshold(&self) -> f32 {
        self.threshold
    }

    /// The stream the kernels run on (allocate buffers and copy with it).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Size in bytes of `n` compressed elements.
    pub fn compressed_len(&self, n: usize) -> usize {
        self.scheme.compressed_size(n)
    }

    /// Queues a quantize of device buffers (same contract as
    /// [`Compressor::quantize`](crate::Compressor::quantize)).
    pub fn quantize(
        &self,
        grad: &CudaSlice<f32>,
        residual: &mut CudaSlice<f32>,
        out: &mut CudaSlice<u8>,
    ) -> Result<(), CompressionError> {
        self.quantize_view(
            &grad.slice(..),
            &mut residual.slice_mut(..),
            &mut out.slice_mut(..),
        )
    }

    /// [`quantize`](Self::quantize) of views: parts of larger buffers, at any element offset
    /// (views not 16-byte aligned take the kernels' element-wise path).
    pub fn quantize_view(
        &self,
        grad: &CudaView<'_, f32>,
        residual: &mut CudaViewMut<'_, f32>,
        out: &mut CudaViewMut<'_, u8>,
    ) -> Result<(), CompressionError> {
        let n = grad.len();
        CompressionError::check_len("residual", n, n, residual.len())?;
        CompressionError::check_len("compressed output", n, self.compressed_len(n), out.len())?;
        let out_len = out.len() as u64;
        if out_len == 0 {
            return Ok(());
        }
        let n = n as u64;
        let (pos, neg) = (self.threshold, -self.threshold);
        let mut launch = self.stream.launch_builder(&self.quantize);
        launch
            .arg(grad)
            .arg(residual)
            .arg(out)
            .arg(&n)
            .arg(&out_len);
        match self.scheme {
            Scheme::TwoBit => launch.arg(&pos).arg(&neg),
            Scheme::OneBit => launch.arg(&pos),
        };
        // A thread per four elements of the padded length, so padding bytes are written too.
        let groups = match self.scheme {
            Scheme::TwoBit => out_len,
            Scheme::OneBit => out_len * 2,
        };
        // SAFETY: the argument list matches the kernel's parameters (pointers, n, out_len,
        // thresholds) and the lengths checked above bound every index the kernel touches.
        guard(|| unsafe { launch.launch(self.config(groups * ELEMS_PER_THREAD)) })
            .map_err(cuda_err("quantize"))?;
        Ok(())
    }

    /// Queues a dequantize of device buffers (`out = decoded`).
    pub fn dequantize(
        &self,
        compressed: &CudaSlice<u8>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CompressionError> {
        self.dequantize_view(&compressed.slice(..), &mut out.slice_mut(..), false)
    }

    /// Queues a dequantize-add of device buffers (`acc += decoded`).
    pub fn dequantize_add(
        &self,
        compressed: &CudaSlice<u8>,
        acc: &mut CudaSlice<f32>,
    ) -> Result<(), CompressionError> {
        self.dequantize_view(&compressed.slice(..), &mut acc.slice_mut(..), true)
    }

    /// Dequantize (`add`: dequantize-add) of views, at any element offset.
    pub fn dequantize_view(
        &self,
        compressed: &CudaView<'_, u8>,
        out: &mut CudaViewMut<'_, f32>,
        add: bool,
    ) -> Result<(), CompressionError> {
        let n = out.len();
        CompressionError::check_len(
            "compressed input",
            n,
            self.compressed_len(n),
            compressed.len(),
        )?;
        if n == 0 {
            return Ok(());
        }
        let (n, add) = (n as u64, i32::from(add));
        let (pos, neg) = (self.threshold, -self.threshold);
        let mut launch = self.stream.launch_builder(&self.dequantize);
        launch.arg(compressed).arg(out).arg(&n);
        if self.scheme == Scheme::TwoBit {
            launch.arg(&pos).arg(&neg);
        }
        launch.arg(&add);
        // SAFETY: the argument list matches the kernel's parameters and the length check
        // above bounds every index the kernel touches.
        guard(|| unsafe { launch.launch(self.config(n)) }).map_err(cuda_err("dequantize"))?;
        Ok(())
    }

    /// Quantize of host slices through the device (copies in, runs, copies back, waits).
    pub fn quantize_host(
        &self,
        grad: &[f32],
        residual: &mut [f32],
        out: &mut [u8],
    ) -> Result<(), CompressionError> {
        let n = grad.len();
        CompressionError::check_len("residual", n, n, residual.len())?;
        CompressionError::check_len("compressed output", n, self.compressed_len(n), out.len())?;
        let d_grad = self.upload(grad)?;
        let mut d_residual = self.upload(residual)?;
        let mut d_out = self.upload(out)?;
        self.quantize(&d_grad, &mut d_residual, &mut d_out)?;
        self.download(&d_residual, residual)?;
        self.download(&d_out, out)
    }

    /// Dequantize of host slices through the device.
    pub fn dequantize_host(
        &self,
        compressed: &[u8],
        out: &mut [f32],
    ) -> Result<(), CompressionError> {
        self.dequantize_host_impl(compressed, out, false)
    }

    /// Dequantize-add of host slices through the device.
    pub fn dequantize_add_host(
        &self,
        compressed: &[u8],
        acc: &mut [f32],
    ) -> Result<(), CompressionError> {
        self.dequantize_host_impl(compressed, acc, true)
    }

    fn dequantize_host_impl(
        &self,
        compressed: &[u8],
        out: &mut [f32],
        add: bool,
    ) -> Result<(), CompressionError> {
        let n = out.len();
        CompressionError::check_len(
            "compressed input",
            n,
            self.compressed_len(n),
            compressed.len(),
        )?;
        let d_in = self.upload(compressed)?;
        let mut d_out = self.upload(out)?;
        self.dequantize_view(&d_in.slice(..), &mut d_out.slice_mut(..), add)?;
        self.download(&d_out, out)
    }

    /// Grid-stride launch over `n` elements, [`ELEMS_PER_THREAD`] per thread.
    fn config(&self, n: u64) -> LaunchConfig {
        grid_stride(n.div_ceil(ELEMS_PER_THREAD), self.max_blocks)
    }

    fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CompressionError> {
        guard(|| self.stream.clone_htod(host)).map_err(cuda_err("copy to device"))
    }

    fn download<T: DeviceRepr>(
        &self,
        dev: &CudaSlice<T>,
        host: &mut [T],
    ) -> Result<(), CompressionError> {
        guard(|| self.stream.memcpy_dtoh(dev, host)).map_err(cuda_err("copy to host"))?;
        guard(|| self.stream.synchronize()).map_err(cuda_err("synchronize"))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Set where NVRTC was installed for the check (CI): its absence is then a failure.
    const REQUIRE_NVRTC: psnet_config::env::EnvVar = psnet_config::env::EnvVar {
        name: "PSNET_REQUIRE_NVRTC",
        default: "",
        description: "tests: fail instead of skipping the kernel compile check without NVRTC",
    };

    /// Each kernel with the byte widths of the arguments `quantize_view` and
    /// `dequantize_view` push, in order: pointers and lengths 8, thresholds (`f32`) and `add`
    /// (`i32`) 4. A kernel whose parameters differ would read garbage on a GPU.
    const ENTRIES: [(&str, &[usize]); 4] = [
        ("psnet_quantize_2bit", &[8, 8, 8, 8, 8, 4, 4]),
        ("psnet_quantize_1bit", &[8, 8, 8, 8, 8, 4]),
        ("psnet_dequantize_2bit", &[8, 8, 8, 4, 4, 4]),
        ("psnet_dequantize_1bit", &[8, 8, 8, 4]),
    ];

    /// Whether NVRTC is here; if not, says that `check` skipped, or fails where
    /// `PSNET_REQUIRE_NVRTC` is set.
    pub(crate) fn nvrtc_or_skip(check: &str) -> bool {
        if nvrtc_present() {
            return true;
        }
        assert!(
            !REQUIRE_NVRTC.is_set(),
            "PSNET_REQUIRE_NVRTC is set, but libnvrtc was not found (LD_LIBRARY_PATH)"
        );
        eprintln!("{check} skipped: libnvrtc was not found (scripts/nvrtc.sh)");
        false
    }

    /// The byte widths of the parameters of PTX entry `name` (`.param .u64 name_param_0`...).
    pub(crate) fn entry_params(ptx: &str, name: &str) -> Option<Vec<usize>> {
        let start = ptx.find(&format!(".entry {name}("))?;
        let rest = &ptx[start..];
        let list = &rest[..rest.find(')')?];
        Some(
            list.split(".param")
                .skip(1)
                .map(|p| {
                    let ty = p.split_whitespace().next().unwrap_or("");
                    match ty.trim_start_matches('.') {
                        "u8" | "s8" | "b8" => 1,
                        "u16" | "s16" | "b16" | "f16" => 2,
                        "u32" | "s32" | "b32" | "f32" => 4,
                        "u64" | "s64" | "b64" | "f64" => 8,
                        _ => 0,
                    }
                })
                .collect(),
        )
    }

    /// The PTX of entry `name`, up to the next entry.
    fn entry_body<'p>(ptx: &'p str, name: &str) -> &'p str {
        let start = ptx.find(&format!(".entry {name}(")).unwrap_or(ptx.len());
        let rest = &ptx[start..];
        let end = rest[1..].find(".entry ").map_or(rest.len(), |e| e + 1);
        &rest[..end]
    }

    /// The instructions of `ptx` that break bit-exactness with the CPU path: a multiply fused
    /// into an add (`fma`, or `mad` on floats) or a flush of denormals to zero (`.ftz`).
    pub(crate) fn inexact_instructions(ptx: &str) -> Vec<String> {
        ptx.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('.') && !l.starts_with("//"))
            .filter_map(|l| l.split_whitespace().find(|w| !w.starts_with('@')))
            .filter(|inst| {
                let float = inst.ends_with(".f32") || inst.ends_with(".f64");
                inst.starts_with("fma.")
                    || (inst.starts_with("mad") && float)
                    || inst.contains(".ftz")
            })
            .map(str::to_owned)
            .collect()
    }

    /// NVRTC needs no GPU, so the kernels, which otherwise only a GPU machine would compile,
    /// are compiled here for NVRTC's default target and for the A100's and H100's, and the
    /// PTX checked: every kernel is there with the parameters the launches pass, its vector
    /// path moves 16 bytes per access, and no instruction fuses a multiply into an add or flushes denormals, which would break
    /// bit-exactness with the CPU path. Skipped, saying why, without libnvrtc (`scripts/nvrtc.sh`
    /// installs one from PyPI); `PSNET_REQUIRE_NVRTC=1` makes that a failure (CI sets it).
    #[test]
    fn the_kernels_compile_with_the_launches_parameters_and_no_fused_or_flushed_arithmetic() {
        if !nvrtc_or_skip("kernel compile check") {
            return;
        }
        for arch in [None, Some("compute_80"), Some("compute_90")] {
            let ptx = compile_source(KERNELS_SRC, "psnet_compression.cu", arch)
                .unwrap_or_else(|e| panic!("compiling for {arch:?}: {e}"))
                .to_src();
            for (name, widths) in ENTRIES {
                let params = entry_params(&ptx, name)
                    .unwrap_or_else(|| panic!("{arch:?}: no entry {name} in the PTX"));
                assert_eq!(params, widths, "{arch:?}: parameters of {name}");
                // The vector path moves a float4 per thread: one 16-byte access, not four.
                let body = entry_body(&ptx, name);
                assert!(
                    body.contains("st.global.v4.f32"),
                    "{arch:?}: {name} has no 16-byte stores"
                );
                if name.contains("quantize_") && !name.contains("dequantize") {
                    assert!(
                        body.contains("ld.global.nc.v4.f32"),
                        "{arch:?}: {name} does not read the gradient 16 bytes at a time \
                         through the read-only path"
                    );
                }
            }
            let inexact = inexact_instructions(&ptx);
            assert!(inexact.is_empty(), "{arch:?}: {inexact:?}");
        }
        // The check itself sees both when they are there: a multiply-add compiled with
        // contraction and flushing allowed.
        let probe = "extern \"C\" __global__ void probe(float* x) { x[0] = x[1] * x[2] + x[3]; }";
        let opts = CompileOptions {
            ftz: Some(true),
            fmad: Some(true),
            ..Default::default()
        };
        let ptx = guard(|| compile_ptx_with_opts(probe, opts))
            .expect("the probe compiles")
            .to_src();
        let inexact = inexact_instructions(&ptx);
        assert!(
            inexact.iter().any(|i| i.starts_with("fma."))
                && inexact.iter().any(|i| i.contains(".ftz")),
            "the probe's fused, flushing multiply-add was not seen: {inexact:?}"
        );
    }
}
