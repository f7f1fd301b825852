//! Which way a GPU buffer reaches the NIC, decided from plain facts (no I/O here): the
//! `PSNET_GPUDIRECT` setting, what the driver and kernel offer ([`Probe`]), the pointer's
//! attributes ([`PointerAttrs`]), and the page arithmetic of a dma-buf registration.
//!
//! Public as `gpu`'s (which re-exports it all); it sits at the bottom of the crate's layers,
//! beside the error types, because the FFI layer (`sys::cuda`, `sys::gpu`) fills and checks
//! these types, and that layer must not depend on `gpu`.

use std::fmt;
use std::str::FromStr;

use crate::error::gpu::GpuError;

/// The environment variable choosing the path: `auto` (default), `dmabuf`, `peermem`,
/// `staged` or `off`.
pub const ENV: &str = psnet_config::env::PSNET_GPUDIRECT.name;

/// How the NIC reaches a GPU buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GpuPath {
    /// The driver exports the range as a dma-buf (`cuMemGetHandleForAddressRange`) and the
    /// NIC registers that (`ibv_reg_dmabuf_mr`): the upstream kernel path (Linux 5.12+).
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer itself, resolved by the `nvidia-peermem` kernel
    /// module (or the older `nv_peer_mem`).
    PeerMem,
    /// No direct path: a pinned, registered host buffer that the caller fills from or drains
    /// into the GPU (`cuMemcpyDtoH` / `cuMemcpyHtoD`).
    Staged,
}

impl GpuPath {
    /// Every path, best first: the order of fall-back.
    pub const ALL: [GpuPath; 3] = [GpuPath::DmaBuf, GpuPath::PeerMem, GpuPath::Staged];

    /// Whether the NIC reads and writes GPU memory itself (no copy through the host).
    pub fn is_direct(self) -> bool {
        !matches!(self, GpuPath::Staged)
    }
}

impl fmt::Display for GpuPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GpuPath::DmaBuf => "dma-buf",
            GpuPath::PeerMem => "nvidia-peermem",
            GpuPath::Staged => "staged through pinned host memory",
        })
    }
}

/// The `PSNET_GPUDIRECT` setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// Best available path, falling back in the order of [`GpuPath::ALL`].
    #[default]
    Auto,
    /// This path only; an error if it is unavailable or fails.
    Only(GpuPath),
    /// GPU registration refused.
    Off,
}

impl FromStr for Mode {
    type Err = GpuError;

    fn from_str(s: &str) -> Result<Mode, GpuError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Mode::Auto),
            "dmabuf" | "dma-buf" => Ok(Mode::Only(GpuPath::DmaBuf)),
            "peermem" | "nvidia-peermem" => Ok(Mode::Only(GpuPath::PeerMem)),
            "staged" => Ok(Mode::Only(GpuPath::Staged)),
            "off" | "0" | "false" | "no" => Ok(Mode::Off),
            _ => Err(GpuError::BadSetting(s.to_owned())),
        }
    }
}

impl Mode {
    /// The setting from `PSNET_GPUDIRECT` (unset: [`Mode::Auto`]).
    pub fn from_env() -> Result<Mode, GpuError> {
        match psnet_config::env::PSNET_GPUDIRECT.get() {
            Some(v) => v.parse(),
            None => Ok(Mode::Auto),
        }
    }
}

/// What this host offers for one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Probe {
    /// The driver exports dma-bufs for this GPU: `cuMemGetHandleForAddressRange` exists and
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` is 1.
    pub dmabuf: bool,
    /// The `nvidia-peermem` (or `nv_peer_mem`) kernel module is loaded.
    pub peermem: bool,
}

/// The paths to try, in order, and why the others are not tried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Paths to try, best first; never empty.
    pub tries: Vec<GpuPath>,
    /// Paths left out, with the reason.
    pub skipped: Vec<(GpuPath, &'static str)>,
}

const NO_DMABUF: &str = "the CUDA driver cannot export this GPU's memory as a dma-buf \
     (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0 or cuMemGetHandleForAddressRange is missing: \
     needs driver 470+ with the open kernel modules, CUDA 11.7+, Linux 5.12+)";
const NO_PEERMEM: &str = "the nvidia-peermem kernel module is not loaded \
     (`modprobe nvidia-peermem`)";
const NOT_CHOSEN: &str = "not chosen by PSNET_GPUDIRECT";

/// The paths to try for `mode` on a host offering `probe`.
///
/// `Auto` tries dma-buf, then nvidia-peermem, each only if the probe says it can work, and
/// always ends with staging. `Only(path)` tries that path alone and fails at once if the
/// probe rules it out; `Off` fails.
pub fn plan(mode: Mode, probe: Probe) -> Result<Plan, GpuError> {
    let unavailable = |path: GpuPath| match path {
        GpuPath::DmaBuf if !probe.dmabuf => Some(NO_DMABUF),
        GpuPath::PeerMem if !probe.peermem => Some(NO_PEERMEM),
        _ => None,
    };
    match mode {
        Mode::Off => Err(GpuError::Disabled),
        Mode::Only(path) => match unavailable(path) {
            Some(reason) => Err(GpuError::Registration(format!(
                "{ENV} asks for {path}, but {reason}"
            ))),
            None => Ok(Plan {
                tries: vec![path],
                skipped: GpuPath::ALL
                    .into_iter()
                    .filter(|p| *p != path)
                    .map(|p| (p, NOT_CHOSEN))
                    .collect(),
            }),
        },
        Mode::Auto => {
            let mut plan = Plan {
                tries: Vec::new(),
                skipped: Vec::new(),
            };
            for path in GpuPath::ALL {
                match unavailable(path) {
                    Some(reason) => plan.skipped.push((path, reason)),
                    None => plan.tries.push(path),
                }
            }
            Ok(plan)
        }
    }
}

/// Runs `attempt` on each path of `tries` in order until one succeeds, logging every failure
/// and the path fallen back to. All failing gives [`GpuError::Registration`] listing each.
pub fn first_success<T>(
    tries: &[GpuPath],
    mut attempt: impl FnMut(GpuPath) -> Result<T, GpuError>,
) -> Result<(GpuPath, T), GpuError> {
    let mut failures = Vec::new();
    for (i, &path) in tries.iter().enumerate() {
        match attempt(path) {
            Ok(value) => return Ok((path, value)),
            // The pointer itself is unusable: no other path can help.
            Err(e @ GpuError::BadPointer(_)) => return Err(e),
            Err(e) => {
                match tries.get(i + 1) {
                    Some(next) => tracing::warn!(
                        failed = %path, next = %next, error = %e,
                        "GPU registration failed; falling back"
                    ),
                    None => tracing::warn!(failed = %path, error = %e, "GPU registration failed"),
                }
                failures.push(format!("{path}: {e}"));
            }
        }
    }
    Err(GpuError::Registration(if failures.is_empty() {
        "no registration path to try".to_owned()
    } else {
        failures.join("; ")
    }))
}

/// `CU_MEMORYTYPE_DEVICE`.
pub const MEMORY_TYPE_DEVICE: u32 = 2;
/// `CU_MEMORYTYPE_HOST`.
pub const MEMORY_TYPE_HOST: u32 = 1;

/// What the driver says about a pointer (`cuPointerGetAttributes`); zeros for memory it does
/// not know.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PointerAttrs {
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` (0: not CUDA memory).
    pub memory_type: u32,
    /// `CU_POINTER_ATTRIBUTE_IS_MANAGED`.
    pub managed: bool,
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
    pub ordinal: i32,
    /// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`: start of the allocation holding the pointer.
    pub base: u64,
    /// `CU_POINTER_ATTRIBUTE_RANGE_SIZE`: its size.
    pub size: u64,
    /// Whether `CU_POINTER_ATTRIBUTE_CONTEXT` named a context.
    pub has_context: bool,
}

/// Checks that `[ptr, ptr + len)` is plain device memory inside one allocation.
pub fn check_pointer(attrs: &PointerAttrs, ptr: u64, len: usize) -> Result<(), GpuError> {
    if len == 0 {
        return Err(GpuError::BadPointer(
            "empty range: register at least one byte".into(),
        ));
    }
    match attrs.memory_type {
        MEMORY_TYPE_DEVICE => {}
        MEMORY_TYPE_HOST => {
            return Err(GpuError::BadPointer(format!(
                "{ptr:#x} is CUDA host memory: register it as ordinary host memory"
            )))
        }
        0 => {
            return Err(GpuError::BadPointer(format!(
                "{ptr:#x} is not memory allocated by the CUDA driver"
            )))
        }
        other => {
            return Err(GpuError::BadPointer(format!(
                "{ptr:#x} has CUDA memory type {other}, not device memory"
            )))
        }
    }
    if attrs.managed {
        return Err(GpuError::BadPointer(format!(
            "{ptr:#x} is managed (unified) memory, which GPUDirect cannot pin: use cuMemAlloc / \
             cudaMalloc memory"
        )));
    }
    if !attrs.has_context {
        return Err(GpuError::BadPointer(format!(
            "the driver names no context for {ptr:#x}"
        )));
    }
    let end = ptr.checked_add(len as u64);
    let alloc_end = attrs.base.checked_add(attrs.size);
    match (end, alloc_end) {
        (Some(end), Some(alloc_end)) if ptr >= attrs.base && end <= alloc_end => Ok(()),
        _ => Err(GpuError::BadPointer(format!(
            "[{ptr:#x}, +{len}) is not inside its allocation [{:#x}, +{})",
            attrs.base, attrs.size
        ))),
    }
}

/// The arguments of a dma-buf export and registration covering `[ptr, ptr + len)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmaBufLayout {
    /// Start of the exported range (the allocation, rounded out to pages).
    pub export_start: u64,
    /// Its length.
    pub export_len: u64,
    /// Offset of the registration in the dma-buf.
    pub offset: u64,
    /// Length of the registration (whole pages).
    pub reg_len: u64,
    /// Address the NIC knows the registration by (the device address of its first byte).
    pub iova: u64,
}

/// Lays out the dma-buf registration of `[ptr, ptr + len)` inside the allocation
/// `[base, base + size)`, rounding both out to `page` (a power of two). `None` on overflow.
pub fn dmabuf_layout(base: u64, size: u64, ptr: u64, len: u64, page: u64) -> Option<DmaBufLayout> {
    let mask = page.checked_sub(1)?;
    let round_up = |x: u64| x.checked_add(mask).map(|v| v & !mask);
    let export_start = base & !mask;
    let export_end = round_up(base.checked_add(size)?)?;
    let iova = ptr & !mask;
    let reg_end = round_up(ptr.checked_add(len)?)?;
    if iova < export_start || reg_end > export_end {
        return None;
    }
    Some(DmaBufLayout {
        export_start,
        export_len: export_end - export_start,
        offset: iova - export_start,
        reg_len: reg_end - iova,
        iova,
    })
}

/// Checks that `[at, at + len)` lies in a region of `total` bytes.
pub fn check_range(at: usize, len: usize, total: usize) -> Result<(), GpuError> {
    match at.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        _ => Err(GpuError::OutOfRange {
            at,
            len,
            region: total,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BOTH: Probe = Probe {
        dmabuf: true,
        peermem: true,
    };
    const NONE: Probe = Probe {
        dmabuf: false,
        peermem: false,
    };

    #[test]
    fn mode_parses_every_documented_value() {
        assert_eq!("auto".parse::<Mode>().unwrap(), Mode::Auto);
        assert_eq!("".parse::<Mode>().unwrap(), Mode::Auto);
        assert_eq!(
            " DMABUF ".parse::<Mode>().unwrap(),
            Mode::Only(GpuPath::DmaBuf)
        );
        assert_eq!(
            "peermem".parse::<Mode>().unwrap(),
            Mode::Only(GpuPath::PeerMem)
        );
        assert_eq!(
            "staged".parse::<Mode>().unwrap(),
            Mode::Only(GpuPath::Staged)
        );
        assert_eq!("off".parse::<Mode>().unwrap(), Mode::Off);
        let err = "gdr".parse::<Mode>().unwrap_err();
        assert_eq!(err, GpuError::BadSetting("gdr".into()));
        assert!(err.to_string().contains("PSNET_GPUDIRECT"), "{err}");
    }

    #[test]
    fn auto_prefers_dmabuf_then_peermem_then_staging() {
        let p = plan(Mode::Auto, BOTH).unwrap();
        assert_eq!(p.tries, GpuPath::ALL.to_vec());
        assert!(p.skipped.is_empty());
    }

    #[test]
    fn auto_decision_table() {
        use GpuPath::*;
        let table = [
            (true, true, vec![DmaBuf, PeerMem, Staged]),
            (true, false, vec![DmaBuf, Staged]),
            (false, true, vec![PeerMem, Staged]),
            (false, false, vec![Staged]),
        ];
        for (dmabuf, peermem, want) in table {
            let p = plan(Mode::Auto, Probe { dmabuf, peermem }).unwrap();
            assert_eq!(p.tries, want, "dmabuf={dmabuf} peermem={peermem}");
            let skipped: Vec<GpuPath> = p.skipped.iter().map(|(p, _)| *p).collect();
            let expect_skipped: Vec<GpuPath> = GpuPath::ALL
                .into_iter()
                .filter(|p| !want.contains(p))
                .collect();
            assert_eq!(skipped, expect_skipped);
        }
        let p = plan(Mode::Auto, NONE).unwrap();
        assert!(p.skipped[0].1.contains("dma-buf"));
        assert!(p.skipped[1].1.contains("nvidia-peermem"));
    }

    #[test]
    fn override_forces_one_path_or_fails() {
        for path in GpuPath::ALL {
            let p = plan(Mode::Only(path), BOTH).unwrap();
            assert_eq!(p.tries, vec![path]);
            assert_eq!(p.skipped.len(), 2);
        }
        // Staging needs nothing from the host.
        assert_eq!(
            plan(Mode::Only(GpuPath::Staged), NONE).unwrap().tries,
            vec![GpuPath::Staged]
        );
        let err = plan(Mode::Only(GpuPath::DmaBuf), NONE).unwrap_err();
        assert!(
            matches!(&err, GpuError::Registration(m) if m.contains("dmabuf") || m.contains("dma-buf")),
            "{err}"
        );
        let err = plan(Mode::Only(GpuPath::PeerMem), NONE).unwrap_err();
        assert!(err.to_string().contains("nvidia-peermem"), "{err}");
        assert_eq!(plan(Mode::Off, BOTH).unwrap_err(), GpuError::Disabled);
    }

    #[test]
    fn fallback_goes_in_order_and_stops_at_first_success() {
        let mut seen = Vec::new();
        let (path, value) = first_success(&GpuPath::ALL, |p| {
            seen.push(p);
            match p {
                GpuPath::DmaBuf => Err(GpuError::Registration("EOPNOTSUPP".into())),
                GpuPath::PeerMem => Ok(7),
                GpuPath::Staged => panic!("tried after a success"),
            }
        })
        .unwrap();
        assert_eq!((path, value), (GpuPath::PeerMem, 7));
        assert_eq!(seen, vec![GpuPath::DmaBuf, GpuPath::PeerMem]);
    }

    #[test]
    fn all_failing_lists_every_reason() {
        let err = first_success::<()>(&GpuPath::ALL, |p| {
            Err(GpuError::Registration(format!("reason-{p:?}")))
        })
        .unwrap_err();
        let msg = err.to_string();
        for p in GpuPath::ALL {
            assert!(msg.contains(&format!("reason-{p:?}")), "{msg}");
        }
        assert!(matches!(
            first_success::<()>(&[], |_| Ok(())),
            Err(GpuError::Registration(_))
        ));
    }

    #[test]
    fn bad_pointer_stops_the_fallback() {
        let mut tried = 0;
        let err = first_success::<()>(&GpuPath::ALL, |_| {
            tried += 1;
            Err(GpuError::BadPointer("host memory".into()))
        })
        .unwrap_err();
        assert_eq!(tried, 1);
        assert!(matches!(err, GpuError::BadPointer(_)));
    }

    fn device_attrs(base: u64, size: u64) -> PointerAttrs {
        PointerAttrs {
            memory_type: MEMORY_TYPE_DEVICE,
            managed: false,
            ordinal: 0,
            base,
            size,
            has_context: true,
        }
    }

    #[test]
    fn pointer_checks() {
        let a = device_attrs(0x1000_0000, 1 << 20);
        assert!(check_pointer(&a, 0x1000_0000, 1 << 20).is_ok());
        assert!(check_pointer(&a, 0x1000_0100, 16).is_ok());
        let bad = |attrs: &PointerAttrs, ptr: u64, len: usize| {
            matches!(check_pointer(attrs, ptr, len), Err(GpuError::BadPointer(_)))
        };
        assert!(bad(&a, 0x1000_0000, 0), "empty");
        assert!(bad(&a, 0x1000_0000, (1 << 20) + 1), "past the end");
        assert!(bad(&a, 0x0fff_ffff, 2), "before the start");
        assert!(bad(&a, u64::MAX, 2), "overflow");
        assert!(bad(&PointerAttrs::default(), 0x1000, 8), "unknown memory");
        let host = PointerAttrs {
            memory_type: MEMORY_TYPE_HOST,
            ..a
        };
        assert!(bad(&host, 0x1000_0000, 8), "host memory");
        let managed = PointerAttrs { managed: true, ..a };
        assert!(bad(&managed, 0x1000_0000, 8), "managed memory");
        let orphan = PointerAttrs {
            has_context: false,
            ..a
        };
        assert!(bad(&orphan, 0x1000_0000, 8), "no context");
    }

    #[test]
    fn dmabuf_layout_of_an_unaligned_slice() {
        // A 100-byte slice 0x1234 bytes into a 2 MiB allocation.
        let l = dmabuf_layout(0x7f00_0000_0000, 2 << 20, 0x7f00_0000_1234, 100, 4096).unwrap();
        assert_eq!(l.export_start, 0x7f00_0000_0000);
        assert_eq!(l.export_len, 2 << 20);
        assert_eq!(l.iova, 0x7f00_0000_1000);
        assert_eq!(l.offset, 0x1000);
        assert_eq!(l.reg_len, 4096);
        assert!(dmabuf_layout(0, 10, u64::MAX - 1, 10, 4096).is_none());
    }

    #[test]
    fn ranges() {
        assert!(check_range(0, 10, 10).is_ok());
        assert!(check_range(10, 0, 10).is_ok());
        assert_eq!(
            check_range(5, 6, 10),
            Err(GpuError::OutOfRange {
                at: 5,
                len: 6,
                region: 10
            })
        );
        assert!(check_range(usize::MAX, 2, 10).is_err());
    }

    fn any_probe() -> impl Strategy<Value = Probe> {
        (any::<bool>(), any::<bool>()).prop_map(|(dmabuf, peermem)| Probe { dmabuf, peermem })
    }

    fn any_mode() -> impl Strategy<Value = Mode> {
        prop_oneof![
            Just(Mode::Auto),
            Just(Mode::Off),
            prop::sample::select(GpuPath::ALL.to_vec()).prop_map(Mode::Only),
        ]
    }

    proptest! {
        /// A plan never tries a path the probe rules out, keeps the fall-back order, names
        /// every path exactly once (tried or skipped), and in auto mode always ends with the
        /// path that needs nothing (staging).
        #[test]
        fn plans_are_ordered_and_complete(mode in any_mode(), probe in any_probe()) {
            match plan(mode, probe) {
                Ok(p) => {
                    prop_assert!(!p.tries.is_empty());
                    prop_assert!(p.tries.windows(2).all(|w| w[0] < w[1]));
                    let mut all: Vec<GpuPath> =
                        p.tries.iter().copied().chain(p.skipped.iter().map(|s| s.0)).collect();
                    all.sort();
                    prop_assert_eq!(all, GpuPath::ALL.to_vec());
                    prop_assert!(!p.tries.contains(&GpuPath::DmaBuf) || probe.dmabuf);
                    prop_assert!(!p.tries.contains(&GpuPath::PeerMem) || probe.peermem);
                    if mode == Mode::Auto {
                        prop_assert_eq!(p.tries.last(), Some(&GpuPath::Staged));
                    }
                }
                Err(_) => prop_assert!(
                    mode == Mode::Off
                        || mode == Mode::Only(GpuPath::DmaBuf) && !probe.dmabuf
                        || mode == Mode::Only(GpuPath::PeerMem) && !probe.peermem
                ),
            }
        }

        /// The registration covers the requested bytes, in whole pages, inside the exported
        /// range, and the NIC address of `ptr` is `ptr` itself.
        #[test]
        fn dmabuf_layout_covers_the_slice(
            base_pages in 0u64..1 << 30,
            size in 1u64..1 << 32,
            start in 0u64..1 << 32,
            len in 1u64..1 << 32,
            page_shift in 12u32..22,
        ) {
            let page = 1u64 << page_shift;
            let base = base_pages * 4096;
            let start = start % size;
            let len = len.min(size - start).max(1);
            let ptr = base + start;
            let l = dmabuf_layout(base, size, ptr, len, page).unwrap();
            prop_assert_eq!(l.export_start % page, 0);
            prop_assert_eq!(l.export_len % page, 0);
            prop_assert_eq!(l.iova % page, 0);
            prop_assert_eq!(l.reg_len % page, 0);
            prop_assert!(l.export_start <= base && base + size <= l.export_start + l.export_len);
            prop_assert!(l.iova <= ptr && ptr + len <= l.iova + l.reg_len);
            prop_assert!(l.reg_len < len + 2 * page);
            prop_assert!(l.offset + l.reg_len <= l.export_len);
            prop_assert_eq!(l.export_start + l.offset, l.iova);
        }
    }
}
