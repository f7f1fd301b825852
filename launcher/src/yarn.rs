//! `--launcher yarn`, through the ResourceManager's REST API (no Hadoop client needed): the
//! scheduler runs where the launcher runs; each server and worker is one YARN application
//! whose container runs the command with its `DMLC_*` variables (`new-application`, then a
//! submission with that container launch context). The launcher follows the applications'
//! states and kills them all (`PUT .../state {"state":"KILLED"}`) when the scheduler fails,
//! when one of them ends badly, or on SIGINT / SIGTERM / SIGHUP.
//!
//! Plain HTTP to the ResourceManager's web address (`yarn.resourcemanager.webapp.address`,
//! e.g. `http://rm:8088`); clusters that demand Kerberos (SPNEGO) on it are not supported.

use std::process::ExitStatus;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::cluster::forwarded_env;
use crate::ssh::shell_quote;
use crate::{process_env, JobSpec, LaunchError, Role};

/// What a YARN job needs beyond the job itself.
#[derive(Clone, Debug)]
pub struct YarnJob {
    /// The ResourceManager's web address, e.g. `http://rm:8088`.
    pub rm: String,
    /// The applications' name prefix.
    pub name: String,
    /// Memory per worker container, MB.
    pub memory_mb: u32,
    /// Virtual cores per worker container.
    pub vcores: u32,
    /// Memory per server container, MB (servers hold the model; workers compute).
    pub server_memory_mb: u32,
    /// Virtual cores per server container.
    pub server_vcores: u32,
    /// The queue, if not the default.
    pub queue: Option<String>,
    /// How often the applications' states are read.
    pub poll: Duration,
}

/// How a YARN job ended.
#[derive(Debug)]
pub struct YarnOutcome {
    /// The applications, by role and index.
    pub apps: Vec<(Role, u32, String)>,
    /// The scheduler's exit status (None: the launcher stopped it).
    pub scheduler: Option<ExitStatus>,
    /// The signal that stopped the job, if one did.
    pub signal: Option<i32>,
    /// Why the job failed, in one line, if it did.
    pub failure: Option<String>,
}

/// A ResourceManager client.
struct Rm {
    base: String,
    agent: ureq::Agent,
}

impl Rm {
    fn new(base: &str) -> Rm {
        Rm {
            base: base.trim_end_matches('/').to_string(),
            agent: ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(30))
                .build(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}/ws/v1/cluster/{path}", self.base)
    }

    fn unreachable(&self, e: &ureq::Error) -> LaunchError {
        match e {
            ureq::Error::Status(code, response) => LaunchError::Invalid(format!(
                "the YARN ResourceManager at {} refused the request (HTTP {code} {})",
                self.base,
                response.status_text()
            )),
            ureq::Error::Transport(t) => LaunchError::Invalid(format!(
                "cannot reach the YARN ResourceManager at {} ({t}): set --yarn-rm to its web \
                 address (yarn.resourcemanager.webapp.address, e.g. http://rm:8088)",
                self.base
            )),
        }
    }

    fn new_application(&self) -> Result<String, LaunchError> {
        let body: Value = self
            .agent
            .post(&self.url("apps/new-application"))
            .call()
            .map_err(|e| self.unreachable(&e))?
            .into_json()
            .map_err(|e| LaunchError::Invalid(format!("new-application: {e}")))?;
        body["application-id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| {
                LaunchError::Invalid(format!(
                    "new-application answered no application-id: {body}"
                ))
            })
    }

    fn submit(&self, context: &Value) -> Result<(), LaunchError> {
        self.agent
            .post(&self.url("apps"))
            .send_json(context.clone())
            .map(|_| ())
            .map_err(|e| self.unreachable(&e))
    }

    /// The application's state and final status (`RUNNING`, `UNDEFINED`; `FINISHED`,
    /// `SUCCEEDED`; `FAILED` / `KILLED`...).
    fn state(&self, id: &str) -> Result<(String, String), LaunchError> {
        let body: Value = self
            .agent
            .get(&self.url(&format!("apps/{id}")))
            .call()
            .map_err(|e| self.unreachable(&e))?
            .into_json()
            .map_err(|e| LaunchError::Invalid(format!("state of {id}: {e}")))?;
        let app = &body["app"];
        Ok((
            app["state"].as_str().unwrap_or("").to_string(),
            app["finalStatus"].as_str().unwrap_or("").to_string(),
        ))
    }

    fn kill(&self, id: &str) {
        let killed = self
            .agent
            .put(&self.url(&format!("apps/{id}/state")))
            .send_json(json!({ "state": "KILLED" }));
        if let Err(e) = killed {
            eprintln!(
                "psnet-launch: cannot kill YARN application {id} ({}); kill it by hand \
                 (yarn application -kill {id})",
                self.unreachable(&e)
            );
        }
    }
}

/// The submission of application `id` running process `index` of `role`.
pub fn submission(
    spec: &JobSpec,
    job: &YarnJob,
    id: &str,
    role: Role,
    index: u32,
    port: u16,
) -> Value {
    let mut env = process_env(spec, role, index, port);
    env.extend(
        forwarded_env()
            .into_iter()
            .filter(|(k, _)| !env.iter().any(|(e, _)| e == k))
            .collect::<Vec<_>>(),
    );
    let cmd: Vec<String> = spec.command.iter().map(|a| shell_quote(a)).collect();
    let mut context = json!({
        "application-id": id,
        "application-name": format!("{}-{}-{index}", job.name, role.as_env()),
        "application-type": "PSNET",
        "max-app-attempts": 1,
        "unmanaged-AM": false,
        "keep-containers-across-application-attempts": false,
        "resource": match role {
            Role::Server => json!({ "memory": job.server_memory_mb, "vCores": job.server_vcores }),
            _ => json!({ "memory": job.memory_mb, "vCores": job.vcores }),
        },
        "am-container-spec": {
            "commands": {
                "command": format!("{} 1><LOG_DIR>/stdout 2><LOG_DIR>/stderr", cmd.join(" "))
            },
            "environment": {
                "entry": env
                    .iter()
                    .map(|(k, v)| json!({ "key": k, "value": v }))
                    .collect::<Vec<_>>()
            }
        }
    });
    if let Some(q) = &job.queue {
        context["queue"] = json!(q);
    }
    context
}

/// Runs the job: the scheduler here, every server and worker as a YARN application.
pub fn launch_yarn(spec: &JobSpec, job: &YarnJob) -> Result<YarnOutcome, LaunchError> {
    if spec.command.is_empty() {
        return Err(LaunchError::Invalid("no command to launch".into()));
    }
    crate::cluster::refuse_inline_secret("a YARN submission (readable by the cluster's users)")?;
    let spec = &crate::queued(spec);
    let rm = Rm::new(&job.rm);
    let port = if spec.root_port == 0 {
        crate::free_port(&spec.root_host)?
    } else {
        spec.root_port
    };
    // The first request also checks that the ResourceManager answers, before anything starts.
    let mut roles: Vec<(Role, u32, String)> = Vec::new();
    for (role, n) in [(Role::Server, spec.servers), (Role::Worker, spec.workers)] {
        for index in 0..n {
            roles.push((role, index, rm.new_application()?));
        }
    }
    let signals = crate::StopSignals::install()?;
    let mut scheduler = crate::spawn_local_scheduler(spec, port)?;
    let stop = crate::stop_local_scheduler;
    let kill_all = |apps: &[(Role, u32, String)]| {
        for (_, _, id) in apps {
            rm.kill(id);
        }
    };
    for (i, (role, index, id)) in roles.iter().enumerate() {
        if let Err(e) = rm.submit(&submission(spec, job, id, *role, *index, port)) {
            kill_all(&roles[..i]);
            stop(&mut scheduler);
            return Err(e);
        }
    }
    eprintln!(
        "psnet-launch: {} YARN applications at {} ({} servers, {} workers); the scheduler runs \
         here on {}:{port}",
        roles.len(),
        job.rm,
        spec.servers,
        spec.workers,
        spec.root_host
    );
    let outcome = |scheduler, signal, failure| YarnOutcome {
        apps: roles.clone(),
        scheduler,
        signal,
        failure,
    };
    let mut next_poll = Instant::now() + job.poll;
    let mut bad: Option<(String, Instant)> = None;
    loop {
        if let Some(status) = scheduler.try_wait().map_err(LaunchError::Wait)? {
            let failure = (!status.success()).then(|| {
                kill_all(&roles);
                let why = bad.as_ref().map_or_else(
                    || "a process of the job failed (its YARN logs say which)".to_string(),
                    |(b, _)| b.clone(),
                );
                format!("the scheduler ended with {status}: {why}; every application killed")
            });
            return Ok(outcome(Some(status), None, failure));
        }
        if let Some(sig) = signals.caught() {
            kill_all(&roles);
            stop(&mut scheduler);
            let why = format!("stopped by signal {sig}; every YARN application killed");
            return Ok(outcome(None, Some(sig), Some(why)));
        }
        if Instant::now() >= next_poll {
            next_poll = Instant::now() + job.poll;
            for (role, index, id) in &roles {
                // A failed poll (a ResourceManager failover, a timeout) is not the job's end.
                let Ok((state, status)) = rm.state(id) else {
                    continue;
                };
                let ended = matches!(state.as_str(), "FINISHED" | "FAILED" | "KILLED");
                if ended && status != "SUCCEEDED" && bad.is_none() {
                    bad = Some((
                        format!(
                            "{} {index} (YARN application {id}) ended {state} / {status}",
                            role.as_env()
                        ),
                        Instant::now(),
                    ));
                }
            }
            // The scheduler notices a lost node by itself; one that never joined it does not.
            if let Some((why, since)) = &bad {
                if since.elapsed() >= spec.grace {
                    kill_all(&roles);
                    stop(&mut scheduler);
                    return Ok(outcome(
                        None,
                        None,
                        Some(format!("{why}; every application killed")),
                    ));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_submission_carries_the_command_and_the_role() {
        let mut spec = JobSpec::new(1, 2, vec!["train".into(), "--x".into(), "a b".into()]);
        spec.root_host = "10.0.0.1".into();
        let job = YarnJob {
            rm: "http://rm:8088".into(),
            name: "psnet-9".into(),
            memory_mb: 2048,
            vcores: 2,
            server_memory_mb: 1024,
            server_vcores: 1,
            queue: Some("gpu".into()),
            poll: Duration::from_secs(1),
        };
        let s = submission(&spec, &job, "application_1_0002", Role::Worker, 1, 9100);
        assert_eq!(s["application-id"], "application_1_0002");
        assert_eq!(s["application-name"], "psnet-9-worker-1");
        assert_eq!(s["resource"]["memory"], 2048);
        let server = submission(&spec, &job, "application_1_0001", Role::Server, 0, 9100);
        assert_eq!(server["resource"], json!({ "memory": 1024, "vCores": 1 }));
        assert_eq!(s["queue"], "gpu");
        let cmd = s["am-container-spec"]["commands"]["command"]
            .as_str()
            .unwrap();
        assert!(
            cmd.starts_with("train --x 'a b' 1><LOG_DIR>/stdout"),
            "{cmd}"
        );
        let env = s["am-container-spec"]["environment"]["entry"]
            .as_array()
            .unwrap();
        let get = |k: &str| {
            env.iter()
                .find(|e| e["key"] == k)
                .map(|e| e["value"].clone())
        };
        assert_eq!(get("DMLC_ROLE"), Some(json!("worker")));
        assert_eq!(get("DMLC_WORKER_ID"), Some(json!("1")));
        assert_eq!(get("DMLC_PS_ROOT_URI"), Some(json!("10.0.0.1")));
        assert_eq!(get("DMLC_PS_ROOT_PORT"), Some(json!("9100")));
    }
}
