//! Tagged output: each line a process writes to stdout or stderr is copied to the launcher's
//! own stdout or stderr behind the process's tag, whole lines at a time, so the lines of
//! different processes never interleave mid-line.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Follows the pipes of the job's processes.
pub(crate) struct Tagger {
    done_tx: mpsc::Sender<()>,
    done_rx: mpsc::Receiver<()>,
    followed: usize,
}

impl Tagger {
    pub(crate) fn new() -> Self {
        let (done_tx, done_rx) = mpsc::channel();
        Tagger {
            done_tx,
            done_rx,
            followed: 0,
        }
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
        self.followed += 1;
        std::thread::spawn(move || {
            let mut reader = BufReader::new(pipe);
            let mut line = Vec::new();
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
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
