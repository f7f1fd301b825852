//! `--launcher ssh`, as MXNet's `launch.py --launcher ssh`: the scheduler runs here; the
//! servers, then the workers, take the hostfile's hosts in turn, each started by
//! `ssh HOST sh -c '...'`, a POSIX shell line (whatever the remote login shell) that enters
//! DIR, exports the process's variables and runs COMMAND behind the watchdog below.
//!
//! No remote process outlives the job: each runs behind a watchdog on its ssh session's
//! standard input, which the launcher holds open and never writes. When the launcher stops a
//! process it kills that process's ssh client, and a launcher that dies closes every pipe:
//! either way sshd closes the remote input, and the watchdog stops the command and what it
//! started (its process group, where the host has `setsid`): SIGTERM, then SIGKILL after 2 s.

use std::process::{Command, Stdio};

use crate::cluster::forwarded_env;
use crate::{process_env, JobSpec, LaunchError, Outcome, Role};

/// What an ssh job needs beyond the job itself.
#[derive(Clone, Debug)]
pub struct SshJob {
    /// The hosts, in the hostfile's order (servers first, then workers, take them in turn).
    pub hosts: Vec<String>,
    /// The directory the command runs in on every host (default: this one's path).
    pub dir: String,
    /// Copy this directory to `dir` on every host with rsync first (`--sync-dst-dir`).
    pub sync: bool,
}

/// The hosts of a hostfile: one per line (`host`, `host slots=N` or `host:N`), comments and
/// blank lines skipped.
pub fn hosts_of_hostfile(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .map(host_of_word)
        .collect()
}

/// The host in a hostfile's first word: `host`, `host:slots`, an IPv6 address, or
/// `[v6]:slots`.
fn host_of_word(word: &str) -> String {
    if word.parse::<std::net::IpAddr>().is_ok() {
        return word.to_string();
    }
    if let Some(rest) = word.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest).to_string();
    }
    word.split(':').next().unwrap_or(word).to_string()
}

/// The host of process `index` of `role` (servers first, then workers, cycling the hosts).
pub fn host_of(hosts: &[String], servers: u32, role: Role, index: u32) -> Option<&str> {
    let slot = match role {
        Role::Scheduler => return None,
        Role::Server => index,
        Role::Worker => servers + index,
    };
    hosts
        .get(slot as usize % hosts.len().max(1))
        .map(String::as_str)
}

/// `text` as one word for a POSIX shell.
pub fn shell_quote(text: &str) -> String {
    if !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,@%+".contains(&b))
    {
        return text.to_string();
    }
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The shell line run on the remote host: the environment, the directory, the command, and
/// the watchdog that stops it when the ssh session's input closes.
pub fn remote_line(env: &[(String, String)], dir: &str, command: &[String]) -> String {
    let exports: Vec<String> = env
        .iter()
        .map(|(k, v)| format!("{k}={}", shell_quote(v)))
        .collect();
    let cmd: Vec<String> = command.iter().map(|a| shell_quote(a)).collect();
    // fd 3 keeps the session's input for the watchdog: an asynchronous list's own input is
    // /dev/null in a shell without job control. With setsid (util-linux) the command leads a
    // process group of its own (a background child is no group leader, so setsid does not
    // fork), and the watchdog stops the whole group: what the command started goes too. The
    // group is written down in the job's dump folder, where the launcher's dump requests
    // find it (`remote_dumps::SshHosts::ask`).
    format!(
        "cd {dir} || exit 127; exec 3<&0; export {exports}; \
         if command -v setsid >/dev/null 2>&1; then setsid {cmd} </dev/null & pid=$!; grp=-$pid; \
         else {cmd} </dev/null & pid=$!; grp=$pid; fi; \
         pidf=\"${{PSNET_RECORDER_DIR:-}}/.psnet-launch-$$.pid\"; \
         [ -n \"${{PSNET_RECORDER_DIR:-}}\" ] && mkdir -p \"$PSNET_RECORDER_DIR\" 2>/dev/null \
         && echo \"$grp\" > \"$pidf\"; \
         {{ while read -r _ <&3; do :; done; kill -TERM $grp 2>/dev/null; sleep 2; \
         kill -KILL $grp 2>/dev/null; }} & dog=$!; wait $pid; rc=$?; kill $dog 2>/dev/null; \
         rm -f \"$pidf\"; exit $rc",
        dir = shell_quote(dir),
        exports = exports.join(" "),
        cmd = cmd.join(" "),
    )
}

pub(crate) fn ssh_command(host: &str, line: &str) -> Command {
    let mut cmd = Command::new("ssh");
    cmd.args([
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "BatchMode=yes",
        host,
        line,
    ]);
    // Held open by the launcher and never written: the watchdog's lifeline.
    cmd.stdin(Stdio::piped());
    cmd
}

/// Copies the current directory to `dir` on every host (rsync over ssh), before the job.
pub fn sync_dirs(hosts: &[String], dir: &str) -> Result<(), LaunchError> {
    let mut seen = std::collections::BTreeSet::new();
    for host in hosts.iter().filter(|h| seen.insert(h.as_str())) {
        let status = Command::new("rsync")
            // No --delete: DIR may hold the user's own files (a home directory, say).
            .args(["-az", "./", &format!("{host}:{dir}")])
            .status()
            .map_err(|e| LaunchError::Invalid(format!("rsync to {host}:{dir}: {e}")))?;
        if !status.success() {
            return Err(LaunchError::Invalid(format!(
                "rsync to {host}:{dir} failed ({status})"
            )));
        }
    }
    Ok(())
}

/// Runs the job: the scheduler here, every server and worker through ssh.
pub fn launch_ssh(spec: &JobSpec, job: &SshJob) -> Result<Outcome, LaunchError> {
    if job.hosts.is_empty() {
        return Err(LaunchError::Invalid("the hostfile names no host".into()));
    }
    if spec.command.is_empty() {
        return Err(LaunchError::Invalid("no command to launch".into()));
    }
    if job.sync {
        sync_dirs(&job.hosts, &job.dir)?;
    }
    crate::cluster::refuse_inline_secret("an ssh command line")?;
    let forwarded = forwarded_env();
    let others = crate::remote_dumps::SshHosts::new(&job.hosts, spec);
    crate::launch_with(spec, &others, |role, index, port| {
        let mut env = process_env(spec, role, index, port);
        match host_of(&job.hosts, spec.servers, role, index) {
            None => {
                let mut cmd = Command::new(&spec.command[0]);
                cmd.args(&spec.command[1..]).envs(env);
                cmd
            }
            Some(host) => {
                let mut all = forwarded.clone();
                all.retain(|(k, _)| !env.iter().any(|(e, _)| e == k));
                env.extend(all);
                // Dumps go to the remote host's own folder (this host's path may not exist
                // there), fetched after a failure.
                let dumps = crate::remote_dumps::remote_export(&spec.env, port);
                if !dumps.is_empty() {
                    env.retain(|(k, _)| k != psnet_config::env::PSNET_RECORDER_DIR.name);
                }
                // Through `sh -c`: the remote login shell may be csh or fish.
                let line = format!(
                    "sh -c {}",
                    shell_quote(&(dumps + &remote_line(&env, &job.dir, &spec.command)))
                );
                ssh_command(host, &line)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_then_workers_cycle_the_hosts() {
        let hosts: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        assert_eq!(host_of(&hosts, 2, Role::Scheduler, 0), None);
        assert_eq!(host_of(&hosts, 2, Role::Server, 0), Some("a"));
        assert_eq!(host_of(&hosts, 2, Role::Server, 1), Some("b"));
        assert_eq!(host_of(&hosts, 2, Role::Worker, 0), Some("c"));
        assert_eq!(host_of(&hosts, 2, Role::Worker, 1), Some("a"));
    }

    #[test]
    fn hostfiles_and_quoting() {
        assert_eq!(
            hosts_of_hostfile("# hosts\nnode1\n\nnode2 slots=4\nnode3:2\nfd00::7\n[fd00::8]:4\n"),
            ["node1", "node2", "node3", "fd00::7", "fd00::8"]
        );
        assert_eq!(shell_quote("plain-1.0"), "plain-1.0");
        assert_eq!(shell_quote("it's $HOME"), r"'it'\''s $HOME'");
        assert_eq!(shell_quote(""), "''");
        let line = remote_line(
            &[("DMLC_ROLE".into(), "worker".into())],
            "/w d",
            &["train".into(), "--x".into(), "a b".into()],
        );
        assert!(line.starts_with("cd '/w d' || exit 127;"), "{line}");
        assert!(line.contains("export DMLC_ROLE=worker;"), "{line}");
        assert!(line.contains("train --x 'a b' </dev/null &"), "{line}");
    }
}
