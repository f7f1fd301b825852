//! Tagged output: each line a process writes to stdout or stderr is copied to the launcher's
//! own stdout or stderr behind the process's tag, whole lines at a time, so the lines of
//! different processes never interleave mid-line.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::Child;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// When any process of the job last wrote a line (`--dump-after` watches it).
pub(crate) struct Activity {
    base: Instant,
    /// Milliseconds after `base`.
    last: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            base: Instant::now(),
            last: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let now = self.base.elapsed().as_millis() as u64;
        self.last.store(now, Ordering::Release);
    }

    /// The last line's time (ms after the job started).
    pub(crate) fn last_ms(&self) -> u64 {
        self.last.load(Ordering::Acquire)
    }

    /// How long no process has written a line.
    pub(crate) fn quiet_for(&self) -> Duration {
        self.base
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last_ms()))
    }
}

/// Follows the pipes of the job's processes.
pub(crate) struct Tagger {
    done_tx: mpsc::Sender<()>,
    done_rx: mpsc::Receiver<()>,
    followed: usize,
    activity: Arc<Activity>,
}

impl Tagger {
    pub(crate) fn new() -> Self {
        let (done_tx, done_rx) = mpsc::channel();
        Tagger {
            done_tx,
            done_rx,
            followed: 0,
            activity: Arc::new(Activity::new()),
        }
    }

    /// When the processes last wrote.
    pub(crate) fn activity(&self) -> Arc<Activity> {
        self.activity.clone()
    }

    /// Copies `child`'s piped stdout and stderr behind `tag`, each on a thread of its own
    /// that ends with the pipe.
    pub(crate) fn follow(&mut self, child: &mut Child, tag: &str) {
        if let Some(out) = child.stdout.take() {
            self.copy(out, tag, false);
        }
        if let Some(err) = child.stderr.take() {
            self.copy(err, tag, true);
        }
    }

    fn copy(&mut self, pipe: impl Read + Send + 'static, tag: &str, to_stderr: bool) {
        let tag = tag.as_bytes().to_vec();
        let done = self.done_tx.clone();
        let activity = self.activity.clone();
        self.followed += 1;
        std::thread::spawn(move || {
            let mut reader = BufReader::new(pipe);
            let mut line = Vec::new();
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        activity.touch();
                        if line.last() != Some(&b'\n') {
                            line.push(b'\n');
                        }
                        let mut whole = Vec::with_capacity(tag.len() + line.len());
                        whole.extend_from_slice(&tag);
                        whole.extend_from_slice(&line);
                        // One write of the whole line under the stream's lock.
                        let _ = if to_stderr {
                            std::io::stderr().lock().write_all(&whole)
                        } else {
                            std::io::stdout().lock().write_all(&whole)
                        };
                    }
                }
            }
            let _ = done.send(());
        });
    }

    /// Waits up to `limit` for every followed pipe to close.
    pub(crate) fn finish(self, limit: Duration) {
        let deadline = Instant::now() + limit;
        for _ in 0..self.followed {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.done_rx.recv_timeout(left).is_err() {
                break;
            }
        }
        let _ = std::io::stdout().flush();
    }
}
