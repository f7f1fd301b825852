//! Writing dumps: the settings, the registry of live recorders, `SIGUSR1`.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once};

use psnet_config::env;
use serde::Serialize;

use crate::{now_us, Record, Recorder, Registered, Scope};

/// The `format` field of every dump, for readers to check.
pub const DUMP_FORMAT: &str = "psnet-recorder-1";

/// When a recorder writes its dump (`PSNET_RECORDER_DUMP`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DumpPolicy {
    /// When an operation fails, a peer is lost, and on `SIGUSR1`.
    Failure,
    /// Also at a clean end.
    Always,
    /// Only on `SIGUSR1`.
    Never,
}

static REGISTRY: Mutex<Registered> = Mutex::new(Vec::new());

pub(crate) fn register(recorder: std::sync::Weak<Recorder>) {
    let mut live = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    live.retain(|w| w.strong_count() > 0);
    live.push(recorder);
}

/// Writes the dump of every live recorder of this process (`reason`: why); returns the files
/// written.
pub fn dump_all(reason: &str) -> Vec<PathBuf> {
    let live: Vec<_> = REGISTRY
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter_map(std::sync::Weak::upgrade)
        .collect();
    live.iter().filter_map(|r| r.dump(reason)).collect()
}

/// Dumps every live recorder when the process gets `SIGUSR1` (a thread waits for it), as
/// `psnet-launch` asks of a hung job. Installed once per process; later calls do nothing.
pub fn install_signal_dump() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let mut signals = match signal_hook::iterator::Signals::new([signal_hook::consts::SIGUSR1])
        {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "flight recorder: SIGUSR1 will not dump (no handler)");
                return;
            }
        };
        let spawned = std::thread::Builder::new()
            .name("psnet-recorder-sigusr1".into())
            .spawn(move || {
                for _ in signals.forever() {
                    dump_all("SIGUSR1");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "flight recorder: SIGUSR1 will not dump (no thread)");
        }
    });
}

/// The directory dumps go to: `PSNET_RECORDER_DIR`, else `psnet-recorder` in the system's
/// temporary directory.
pub fn dump_dir() -> PathBuf {
    env::PSNET_RECORDER_DIR
        .get()
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("psnet-recorder"))
}

/// A recorder's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Operations kept (0: no recorder).
    pub entries: usize,
    /// When to dump.
    pub policy: DumpPolicy,
    /// Where.
    pub dir: PathBuf,
    /// Where a Chrome trace and a dump go at a clean end (`PSNET_TIMELINE`).
    pub timeline: Option<PathBuf>,
}

impl Default for Settings {
    /// 4096 entries, dumps on failure, to `psnet-recorder` in the system's temporary
    /// directory (the environment's defaults).
    fn default() -> Self {
        Settings {
            entries: DEFAULT_ENTRIES,
            policy: DumpPolicy::Failure,
            dir: std::env::temp_dir().join("psnet-recorder"),
            timeline: None,
        }
    }
}

const DEFAULT_ENTRIES: usize = 4096;

impl Settings {
    /// From `PSNET_RECORDER_ENTRIES`, `PSNET_RECORDER_DUMP` and `PSNET_RECORDER_DIR`. A value
    /// that does not parse is logged and its default taken: a recorder's settings never stop
    /// a job.
    pub fn from_env() -> Self {
        let (entries, policy, dir) = settings_from_env();
        Settings {
            entries,
            policy,
            dir,
            timeline: env::PSNET_TIMELINE.get().map(PathBuf::from),
        }
    }
}

fn settings_from_env() -> (usize, DumpPolicy, PathBuf) {
    let capacity = env::PSNET_RECORDER_ENTRIES
        .parse_or_default::<usize>()
        .unwrap_or_else(|e| {
            tracing::warn!(error = %e, "flight recorder: taking the default size");
            DEFAULT_ENTRIES
        });
    let policy = match env::PSNET_RECORDER_DUMP.get().as_deref().map(str::trim) {
        None | Some("failure") => DumpPolicy::Failure,
        Some("always") => DumpPolicy::Always,
        Some("never") => DumpPolicy::Never,
        Some(other) => {
            tracing::warn!(
                value = other,
                "PSNET_RECORDER_DUMP is failure, always or never: taking failure"
            );
            DumpPolicy::Failure
        }
    };
    (capacity, policy, dump_dir())
}

#[derive(Serialize)]
struct Dump<'a> {
    format: &'static str,
    scope: &'a Scope,
    pid: u32,
    reason: &'a str,
    written_us: u64,
    /// Older records the ring let go.
    dropped: u64,
    records: &'a [Record],
}

/// The dump's file for `recorder` in its directory.
pub(crate) fn path_of(dir: &Path, scope: &Scope) -> PathBuf {
    dir.join(format!(
        "psnet-{}-{}.json",
        scope.file_stem(),
        std::process::id()
    ))
}

/// Writes `recorder`'s dump: to a file aside, then renamed over the last one, so a reader
/// never sees half a dump.
pub(crate) fn write(recorder: &Recorder, reason: &str) -> io::Result<PathBuf> {
    write_to(recorder, reason, recorder.dir())
}

/// [`write`] into `dir`, then (with `trace`) the same as a Chrome trace beside it.
pub(crate) fn write_to(recorder: &Recorder, reason: &str, dir: &Path) -> io::Result<PathBuf> {
    let (records, dropped) = recorder.snapshot();
    let dump = Dump {
        format: DUMP_FORMAT,
        scope: recorder.scope(),
        pid: std::process::id(),
        reason,
        written_us: now_us(),
        dropped,
        records: &records,
    };
    std::fs::create_dir_all(dir)?;
    let path = path_of(dir, recorder.scope());
    let aside = path.with_extension("json.tmp");
    let mut file = std::fs::File::create(&aside)?;
    serde_json::to_writer(&mut file, &dump).map_err(io::Error::other)?;
    file.write_all(b"\n")?;
    file.sync_all()?;
    std::fs::rename(&aside, &path)?;
    Ok(path)
}

/// `PSNET_TIMELINE`: `recorder`'s dump into `dir`, and the same as a Chrome trace
/// (`<scope>-<pid>.trace.json`).
pub(crate) fn write_timeline(recorder: &Recorder, dir: &Path) -> io::Result<PathBuf> {
    let dump_path = write_to(recorder, "clean end (PSNET_TIMELINE)", dir)?;
    let text = std::fs::read_to_string(&dump_path)?;
    let mut dump: crate::doctor::DumpFile =
        serde_json::from_str(&text).map_err(io::Error::other)?;
    dump.path = dump_path.clone();
    let trace = crate::timeline::chrome_trace(std::slice::from_ref(&dump));
    let path = dump_path.with_extension("trace.json");
    std::fs::write(&path, serde_json::to_vec(&trace).map_err(io::Error::other)?)?;
    Ok(path)
}
