//! The flight recorder dumps of a job's processes on other hosts (`--launcher ssh`): where
//! they write them, asking them for dumps (`SIGUSR1` to the launcher, `--dump-after`), and
//! bringing their dumps into the launcher's folder, so that `psnet-doctor` reads the whole job
//! in one place.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use psnet_config::env;

use crate::dumps::{self, OtherHosts};
use crate::ssh::{host_of, shell_quote, ssh_command};
use crate::{JobSpec, Role};

/// How long one host may take to send its dumps.
const FETCH_LIMIT: Duration = Duration::from_secs(30);

/// The folder a process on another host dumps into, as a word for its shell: the folder the
/// user set (`PSNET_RECORDER_DIR`), else one of the job's under that host's own temporary
/// directory, as the launcher's is here.
pub(crate) fn remote_dir(spec_env: &[(String, String)], port: u16) -> String {
    match dumps::told_dir(spec_env) {
        Some(dir) => shell_quote(&dir),
        None => format!("\"${{TMPDIR:-/tmp}}\"/psnet-recorder/job-{port}"),
    }
}

/// What a remote line starts with to dump there; nothing where the user set the folder (the
/// environment carries it).
pub(crate) fn remote_export(spec_env: &[(String, String)], port: u16) -> String {
    match dumps::told_dir(spec_env) {
        Some(_) => String::new(),
        None => format!(
            "{name}={dir}; export {name}; ",
            name = env::PSNET_RECORDER_DIR.name,
            dir = remote_dir(spec_env, port)
        ),
    }
}

/// Copies every dump in the job's folder on each of `hosts` into `dir` (ssh, and `tar` at
/// both ends); says on stderr what came from where. A host that cannot be reached, or takes
/// longer than [`FETCH_LIMIT`], is named and skipped.
fn fetch(hosts: &[String], spec_env: &[(String, String)], dir: &Path, port: u16) {
    let line = format!(
        "none() {{ exec tar cf - --files-from /dev/null; }}; cd {} 2>/dev/null || none; \
         set -- psnet-*.json; [ -e \"$1\" ] || none; exec tar cf - -- \"$@\"",
        remote_dir(spec_env, port)
    );
    if let Err(e) = std::fs::create_dir_all(dir) {
        eprintln!(
            "psnet-launch: cannot make {} for the other hosts' dumps: {e}",
            dir.display()
        );
        return;
    }
    let mut seen = std::collections::BTreeSet::new();
    for host in hosts.iter().filter(|h| seen.insert(h.as_str())) {
        let before = count(dir);
        match fetch_one(host, &line, dir) {
            Ok(()) => {
                let got = count(dir).saturating_sub(before);
                if got > 0 {
                    eprintln!(
                        "psnet-launch: {got} flight recorder dumps from {host} copied into {}",
                        dir.display()
                    );
                }
            }
            Err(why) => eprintln!("psnet-launch: no dumps from {host}: {why}"),
        }
    }
}

fn count(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| {
        d.filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
            .count()
    })
}

fn fetch_one(host: &str, line: &str, dir: &Path) -> Result<(), String> {
    let mut ssh = ssh_command(host, &format!("sh -c {}", shell_quote(line)));
    ssh.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut ssh = ssh.spawn().map_err(|e| format!("ssh: {e}"))?;
    let from_ssh = ssh.stdout.take().expect("piped");
    let tar = Command::new("tar")
        .args(["xf", "-", "--no-same-owner", "-C"])
        .arg(dir)
        .stdin(Stdio::from(from_ssh))
        .stderr(Stdio::null())
        .spawn();
    let mut tar = match tar {
        Ok(t) => t,
        Err(e) => {
            let _ = ssh.kill();
            let _ = ssh.wait();
            return Err(format!("tar: {e}"));
        }
    };
    let deadline = Instant::now() + FETCH_LIMIT;
    let ssh_ok = wait_until(&mut ssh, deadline)?;
    let tar_ok = wait_until(&mut tar, deadline)?;
    match (ssh_ok, tar_ok) {
        (true, true) => Ok(()),
        (false, _) => Err("ssh failed".into()),
        (_, false) => Err("what came was not a tar stream of dumps".into()),
    }
}

/// Whether `child` exited successfully by `deadline`; killed and an error past it.
fn wait_until(child: &mut Child, deadline: Instant) -> Result<bool, String> {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status.success()),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no answer within {} s", FETCH_LIMIT.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The hosts of an ssh job: each server and worker on the host the hostfile gives it, the
/// scheduler here.
pub(crate) struct SshHosts<'a> {
    hosts: &'a [String],
    servers: u32,
    spec_env: &'a [(String, String)],
    /// Every host a process of the job runs on, each once.
    used: Vec<String>,
}

impl<'a> SshHosts<'a> {
    pub(crate) fn new(hosts: &'a [String], spec: &'a JobSpec) -> Self {
        let mut used: Vec<String> = Vec::new();
        let all = (0..spec.servers)
            .map(|i| (Role::Server, i))
            .chain((0..spec.workers).map(|i| (Role::Worker, i)));
        for (role, i) in all {
            if let Some(h) = host_of(hosts, spec.servers, role, i) {
                if !used.iter().any(|u| u == h) {
                    used.push(h.to_string());
                }
            }
        }
        SshHosts {
            hosts,
            servers: spec.servers,
            spec_env: &spec.env,
            used,
        }
    }
}

impl OtherHosts for SshHosts<'_> {
    fn is_remote(&self, role: Role, index: u32) -> bool {
        host_of(self.hosts, self.servers, role, index).is_some()
    }

    fn count(&self) -> usize {
        self.used.len()
    }

    /// `SIGUSR1` to the process group every remote line wrote down in the job's dump folder
    /// there (`ssh::remote_line`).
    fn ask(&self, port: u16) {
        let line = format!(
            "cd {} 2>/dev/null || exit 0; for f in .psnet-launch-*.pid; do \
             [ -e \"$f\" ] && kill -USR1 \"$(cat \"$f\")\" 2>/dev/null; done; exit 0",
            remote_dir(self.spec_env, port)
        );
        for host in &self.used {
            let mut ssh = ssh_command(host, &format!("sh -c {}", shell_quote(&line)));
            ssh.stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let asked = ssh
                .spawn()
                .map_err(|e| format!("ssh: {e}"))
                .and_then(|mut c| wait_until(&mut c, Instant::now() + FETCH_LIMIT));
            if !matches!(asked, Ok(true)) {
                eprintln!("psnet-launch: could not ask the processes on {host} for their dumps");
            }
        }
    }

    fn fetch(&self, dir: &Path, port: u16) {
        fetch(&self.used, self.spec_env, dir, port);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_processes_dump_under_their_hosts_temporary_directory_unless_told() {
        let none: Vec<(String, String)> = Vec::new();
        assert_eq!(
            remote_export(&none, 9000).replace("PSNET_RECORDER_DIR", "D"),
            "D=\"${TMPDIR:-/tmp}\"/psnet-recorder/job-9000; export D; "
        );
        let told = vec![(
            "PSNET_RECORDER_DIR".to_string(),
            "/shared/dumps here".to_string(),
        )];
        assert_eq!(remote_export(&told, 9000), "");
        assert_eq!(remote_dir(&told, 9000), "'/shared/dumps here'");
    }
}
