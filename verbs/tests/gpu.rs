//! GPUDirect without a GPU: the missing CUDA driver is an error value naming libcuda, never a
//! panic, and the rest of the crate is untouched by it.
#![cfg(feature = "cuda")]

use psnet_config::env::harness_var;
use std::ffi::CString;

use psnet_verbs::gpu::{Driver, GpuError, GpuPath, Mode};

/// Whether the dynamic loader finds a CUDA driver library, checked independently of the
/// crate (plain `dlopen`).
fn driver_library_present() -> bool {
    ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
        let name = CString::new(*name).expect("no NUL in the name");
        // SAFETY: dlopen with a valid C string; a handle it returns is closed at once.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return false;
        }
        // SAFETY: `handle` was just returned by dlopen and is not used afterwards.
        unsafe { libc::dlclose(handle) };
        true
    })
}

#[test]
fn missing_driver_is_reported_as_no_driver() {
    if driver_library_present() {
        println!("SKIPPED: a CUDA driver is present (libcuda loads), so NoDriver cannot be shown");
        return;
    }
    let first = Driver::load().expect_err("no libcuda on this host, yet the driver loaded");
    assert_eq!(first, GpuError::NoDriver);
    let msg = first.to_string();
    assert!(
        msg.contains("libcuda.so.1"),
        "message must name libcuda: {msg}"
    );
    assert!(
        msg.contains("install the NVIDIA driver"),
        "message must say what to do: {msg}"
    );
    // Cached and stable: asking again neither panics nor changes the answer.
    assert_eq!(Driver::load().unwrap_err(), GpuError::NoDriver);
}

#[test]
fn loading_never_panics_whatever_the_host() {
    // With or without a driver, the answer is a value: a loaded driver has a device.
    match std::panic::catch_unwind(Driver::load) {
        Ok(Ok(driver)) => {
            assert!(driver.device_count() > 0);
            assert!(driver.version() > 0);
        }
        Ok(Err(e)) => assert!(!e.to_string().is_empty()),
        Err(_) => panic!("Driver::load panicked"),
    }
}

#[test]
fn setting_values_are_documented_ones() {
    assert_eq!("auto".parse::<Mode>(), Ok(Mode::Auto));
    assert_eq!("staged".parse::<Mode>(), Ok(Mode::Only(GpuPath::Staged)));
    let err = "yes-please".parse::<Mode>().unwrap_err();
    assert!(matches!(err, GpuError::BadSetting(_)));
    assert!(err
        .to_string()
        .contains("auto, dmabuf, peermem, staged or off"));
}

#[test]
fn the_rest_of_the_crate_works_without_a_gpu() {
    // Device discovery does not depend on CUDA: it answers (a list, possibly empty, or an
    // error saying libibverbs is missing) whether or not a driver exists.
    let _ = psnet_verbs::devices::verbs_devices();
    let _ = Driver::load();
    let _ = psnet_verbs::devices::verbs_devices();
}

/// A stand-in for `libcuda.so.1`, built with the C compiler for the fake-driver tests:
/// `-DEMPTY` gives a library without any CUDA symbol (a broken or foreign install); otherwise
/// `INIT_RC` is what `cuInit` returns, `DEVICES` the device count, and `WITH_DMABUF` adds the
/// dma-buf export. Its "device memory" is host memory: any non-null pointer is reported as
/// device memory at the start of a 1 MiB allocation owned by context 0x1, and copies are
/// `memcpy`.
const FAKE_LIBCUDA: &str = r#"
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef EMPTY
int psnet_not_cuda(void) { return 0; }
#else
typedef int CUresult;
CUresult cuInit(unsigned flags) { (void)flags; return INIT_RC; }
CUresult cuDriverGetVersion(int *v) { *v = 12040; return 0; }
CUresult cuDeviceGetCount(int *c) { *c = DEVICES; return 0; }
CUresult cuDeviceGet(int *d, int ordinal) { *d = ordinal; return 0; }
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
    (void)dev; *v = attr == 124; return 0;
}
CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; *s = "CUDA_ERROR_FAKE"; return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "fake failure"; return 0; }
CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, unsigned long long ptr) {
    for (unsigned i = 0; i < n; i++) {
        switch (attrs[i]) {
        case 1: *(void **)data[i] = ptr ? (void *)1 : NULL; break;
        case 2: *(unsigned *)data[i] = ptr ? 2 : 0; break;
        case 8: *(unsigned *)data[i] = 0; break;
        case 9: *(int *)data[i] = 0; break;
        case 11: *(unsigned long long *)data[i] = ptr; break;
        case 12: *(size_t *)data[i] = ptr ? (1u << 20) : 0; break;
        default: return 1;
        }
    }
    return 0;
}
CUresult cuCtxPushCurrent_v2(void *ctx) { return ctx == (void *)1 ? 0 : 201; }
CUresult cuCtxPopCurrent_v2(void **ctx) { *ctx = (void *)1; return 0; }
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned f) { (void)p; (void)n; return f == 1 ? 0 : 1; }
CUresult cuMemHostUnregister(void *p) { (void)p; return 0; }
CUresult cuMemcpyDtoH_v2(void *dst, unsigned long long src, size_t n) {
    memcpy(dst, (const void *)(uintptr_t)src, n); return 0;
}
CUresult cuMemcpyHtoD_v2(unsigned long long dst, const void *src, size_t n) {
    memcpy((void *)(uintptr_t)dst, src, n); return 0;
}
#ifdef WITH_DMABUF
CUresult cuMemGetHandleForAddressRange(void *handle, unsigned long long p, size_t n, int type,
                                       unsigned long long flags) {
    (void)p; (void)n; (void)flags;
    if (type != 1) return 1;
    *(int *)handle = open("/dev/null", O_RDONLY | O_CLOEXEC);
    return 0;
}
#endif
#endif
"#;

/// Set in the child process of a fake-driver case: which case it checks.
const FAKE_CASE: &str = "PSNET_TEST_FAKE_LIBCUDA_CASE";

/// Builds the fake driver with `defines` into `dir` (as `libcuda.so.1` and `libcuda.so`);
/// `false` if no C compiler is available.
fn build_fake_libcuda(dir: &std::path::Path, defines: &[&str]) -> bool {
    let src = dir.join("fake_libcuda.c");
    std::fs::write(&src, FAKE_LIBCUDA).expect("write the fake driver's source");
    let lib = dir.join("libcuda.so.1");
    let status = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .args(defines)
        .status();
    match status {
        Ok(s) if s.success() => {
            std::fs::copy(&lib, dir.join("libcuda.so")).expect("copy the fake driver");
            true
        }
        Ok(s) => panic!("the fake driver did not compile: {s}"),
        Err(_) => false,
    }
}

/// Runs [`fake_driver_child`] in a new process that finds the fake driver first.
fn run_fake_case(case: &str, defines: &[&str]) {
    let dir = tempfile::tempdir().expect("temporary directory");
    if !build_fake_libcuda(dir.path(), defines) {
        println!("SKIPPED: no C compiler (cc) to build a fake libcuda for case {case}");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "fake_driver_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LD_LIBRARY_PATH", dir.path())
        .env(FAKE_CASE, case)
        .output()
        .expect("run the child test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(&format!("CHECKED {case}")),
        "case {case} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        !stderr.contains("panicked"),
        "case {case} panicked:\n{stderr}"
    );
}

#[test]
fn a_library_without_cuda_symbols_is_an_error_not_a_panic() {
    run_fake_case("empty", &["-DEMPTY"]);
}

#[test]
fn a_stub_driver_counts_as_no_driver() {
    // CUDA_ERROR_STUB_LIBRARY: the toolkit's libcuda stub, not a driver.
    run_fake_case("stub", &["-DINIT_RC=34", "-DDEVICES=1"]);
}

#[test]
fn a_driver_without_devices_is_no_device() {
    run_fake_case("no-device-init", &["-DINIT_RC=100", "-DDEVICES=0"]);
    run_fake_case("zero-devices", &["-DINIT_RC=0", "-DDEVICES=0"]);
}

#[test]
fn a_failing_cuinit_is_a_cuda_error_naming_the_call() {
    run_fake_case("init-fails", &["-DINIT_RC=3", "-DDEVICES=1"]);
}

#[test]
fn a_working_driver_reports_pointers_and_stages_copies() {
    run_fake_case("full", &["-DINIT_RC=0", "-DDEVICES=2", "-DWITH_DMABUF"]);
    run_fake_case("no-dmabuf", &["-DINIT_RC=0", "-DDEVICES=1"]);
}

/// The child side of the fake-driver cases (does nothing unless started by one).
#[test]
fn fake_driver_child() {
    use psnet_verbs::gpu::{check_pointer, PinnedHost};

    let Some(case) = harness_var(FAKE_CASE) else {
        return;
    };
    let loaded = Driver::load();
    match case.as_str() {
        "empty" => {
            let err = loaded.unwrap_err();
            assert!(
                matches!(&err, GpuError::Cuda(m) if m.contains("lacks cuInit")),
                "{err}"
            );
        }
        "stub" => assert_eq!(loaded.unwrap_err(), GpuError::NoDriver),
        "no-device-init" | "zero-devices" => {
            assert!(matches!(loaded, Err(GpuError::NoDevice(_))), "{loaded:?}")
        }
        "init-fails" => {
            let err = loaded.unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, GpuError::Cuda(_)), "{msg}");
            assert!(
                msg.contains("cuInit") && msg.contains("CUDA_ERROR_FAKE"),
                "{msg}"
            );
        }
        "full" | "no-dmabuf" => {
            let driver = loaded.expect("the fake driver loads");
            assert_eq!(driver.version(), 12040);
            assert_eq!(driver.device_count(), if case == "full" { 2 } else { 1 });
            assert_eq!(driver.has_dmabuf_export(), case == "full");
            assert_eq!(driver.dmabuf_supported(0), Ok(case == "full"));

            // "Device memory" of the fake driver is this vector.
            let mut gpu = vec![0u8; 1 << 20];
            let ptr = gpu.as_mut_ptr() as u64;
            let (attrs, ctx) = driver.pointer(ptr).expect("pointer attributes");
            assert_eq!(attrs.memory_type, 2);
            assert_eq!((attrs.base, attrs.size), (ptr, 1 << 20));
            assert!(attrs.has_context && !attrs.managed);
            check_pointer(&attrs, ptr + 100, 1000).expect("inside the allocation");
            assert!(matches!(
                check_pointer(&attrs, ptr + 100, 1 << 20),
                Err(GpuError::BadPointer(_))
            ));
            let (unknown, _) = driver.pointer(0).expect("attributes of null");
            assert!(matches!(
                check_pointer(&unknown, 0, 8),
                Err(GpuError::BadPointer(_))
            ));

            match driver.export_dmabuf(ctx, ptr, 1 << 20) {
                Ok(fd) => assert!(case == "full", "exported without the entry point: {fd:?}"),
                Err(e) => assert!(
                    case == "no-dmabuf" && matches!(e, GpuError::Registration(_)),
                    "{e}"
                ),
            }

            // Staging: device -> pinned host -> device, as GpuRegion's copies do.
            for (i, b) in gpu.iter_mut().enumerate() {
                *b = (i % 251) as u8;
            }
            let host = PinnedHost::new(driver, ctx, 5000).expect("pinned staging buffer");
            assert!(host.capacity() >= 5000 && host.capacity() % 4096 == 0);
            // SAFETY: the host buffer has at least 5000 bytes and no reference into it
            // exists; the "device" range lies in `gpu`, alive for the whole test.
            unsafe { driver.copy_dtoh(ctx, host.as_ptr(), ptr + 10, 5000) }.expect("DtoH");
            // SAFETY: as above; the copy back lands at another offset of `gpu`.
            unsafe { driver.copy_htod(ctx, ptr + 600_000, host.as_ptr(), 5000) }.expect("HtoD");
            assert_eq!(gpu[600_000..605_000], gpu[10..5010]);
            drop(host);
        }
        other => panic!("unknown fake-driver case {other}"),
    }
    println!("CHECKED {case}");
}
