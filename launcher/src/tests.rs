use super::*;

#[test]
fn environment_names_role_and_shape() {
    let mut spec = JobSpec::new(2, 3, vec!["prog".into()]);
    spec.env.push(("PS_VERBOSE".into(), "1".into()));
    let env = process_env(&spec, Role::Server, 1, 9000);
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    assert_eq!(get("DMLC_ROLE"), Some("server"));
    assert_eq!(get("DMLC_PS_ROOT_URI"), Some("127.0.0.1"));
    assert_eq!(get("DMLC_PS_ROOT_PORT"), Some("9000"));
    assert_eq!(get("DMLC_NUM_SERVER"), Some("2"));
    assert_eq!(get("DMLC_NUM_WORKER"), Some("3"));
    assert_eq!(get("PS_VERBOSE"), Some("1"));
    assert_eq!(
        get("DMLC_SERVER_ID"),
        Some("1"),
        "the rank the launcher numbers it by"
    );
    assert_eq!(get("DMLC_WORKER_ID"), None);
    if !env::DMLC_INTERFACE.is_set() && !env::DMLC_NODE_HOST.is_set() {
        assert_eq!(
            get("DMLC_NODE_HOST"),
            Some("127.0.0.1"),
            "a loopback job stays on loopback"
        );
    }
    spec.env.push(("DMLC_INTERFACE".into(), "eth0".into()));
    let env = process_env(&spec, Role::Worker, 2, 9000);
    assert!(env.contains(&("DMLC_WORKER_ID".into(), "2".into())));
    assert!(!env.iter().any(|(k, _)| k == "DMLC_NODE_HOST"));
}

#[test]
fn every_process_runs_and_success_is_reported() {
    let spec = JobSpec::new(
        2,
        2,
        vec!["sh".into(), "-c".into(), "test -n \"$DMLC_ROLE\"".into()],
    );
    let out = launch_local(&spec).unwrap();
    assert!(out.success(), "{out:?}");
    assert_eq!(out.ended.len(), 5);
}

#[test]
fn a_dying_server_is_started_again_with_its_rank_up_to_the_limit() {
    // Server 1 fails on its first two starts (a marker file counts them), then succeeds;
    // everyone else succeeds at once.
    let dir = std::env::temp_dir().join(format!("psnet-launch-restart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = format!(
        "if [ \"$DMLC_ROLE\" = server ] && [ \"$DMLC_SERVER_ID\" = 1 ]; then \
           n=$(cat {d}/starts 2>/dev/null || echo 0); echo $((n+1)) > {d}/starts; \
           [ $n -ge 2 ] || exit 7; fi",
        d = dir.display()
    );
    let mut spec = JobSpec::new(2, 1, vec!["sh".into(), "-c".into(), script]);
    spec.env
        .push(("PSNET_CHECKPOINT_DIR".into(), dir.display().to_string()));
    spec.max_restarts = 2;
    let out = launch_local(&spec).unwrap();
    assert!(out.success(), "{out:?}");
    assert_eq!(
        out.ended.len(),
        6,
        "two failed starts and four processes: {out:?}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("starts")).unwrap().trim(),
        "3"
    );
    // One restart fewer than needed: the second failure stops the job, blamed on it.
    std::fs::remove_file(dir.join("starts")).unwrap();
    spec.max_restarts = 1;
    spec.grace = Duration::from_millis(200);
    let out = launch_local(&spec).unwrap();
    assert_eq!(out.failure_code(), Some(7), "{out:?}");
    let (role, index, _) = out.first_failure.expect("failure reported");
    assert_eq!((role, index), (Role::Server, 1));
    // Restarts without a checkpoint directory would bring a server back empty: refused.
    spec.env.clear();
    let err = launch_local(&spec).unwrap_err().to_string();
    assert!(err.contains("PSNET_CHECKPOINT_DIR"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn one_failure_stops_the_rest_after_the_grace_period() {
    let script = "if [ \"$DMLC_ROLE\" = worker ]; then exit 3; else sleep 30; fi";
    let mut spec = JobSpec::new(1, 1, vec!["sh".into(), "-c".into(), script.into()]);
    spec.grace = Duration::from_millis(200);
    let started = Instant::now();
    let out = launch_local(&spec).unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "others were not stopped"
    );
    assert_eq!(out.failure_code(), Some(3), "the failing worker's own code");
    let (role, _, status) = out.first_failure.expect("failure reported");
    assert_eq!(role, Role::Worker);
    assert!(status.contains('3'), "{status}");
    assert_eq!(out.ended.iter().filter(|e| e.status.is_none()).count(), 2);
}

#[test]
fn the_process_that_failed_by_its_own_exit_is_blamed_not_the_ones_that_noticed() {
    // The scheduler and the worker report a lost peer (exit 2) before the launcher sees
    // the killed server's own end, as when the server's exit is reaped a poll later.
    let script = "case \"$DMLC_ROLE\" in server) sleep 0.1; kill -9 $$;; *) exit 2;; esac";
    let mut spec = JobSpec::new(1, 1, vec!["sh".into(), "-c".into(), script.into()]);
    spec.grace = Duration::from_millis(500);
    let out = launch_local(&spec).unwrap();
    let (role, _, status) = out.first_failure.clone().expect("failure reported");
    assert_eq!(role, Role::Server, "{out:?}");
    assert!(status.contains("signal"), "{status}");
    assert_eq!(out.failure_code(), Some(128 + 9), "killed by SIGKILL");
    // Only processes that noticed: the first of them is blamed.
    let out = launch_local(&JobSpec::new(
        1,
        1,
        vec!["sh".into(), "-c".into(), "exit 2".into()],
    ))
    .unwrap();
    assert!(out.first_failure.is_some());
}

#[test]
fn queued_jobs_wait_for_registration_without_limit_unless_told() {
    let spec = JobSpec::new(1, 1, vec!["prog".into()]);
    let limit = |s: &JobSpec| {
        s.env
            .iter()
            .find(|(k, _)| k == "PSNET_BOOTSTRAP_TIMEOUT")
            .map(|(_, v)| v.clone())
    };
    if !env::PSNET_BOOTSTRAP_TIMEOUT.is_set() {
        assert_eq!(limit(&queued(&spec)).as_deref(), Some("0"));
    }
    let mut told = spec.clone();
    told.env
        .push(("PSNET_BOOTSTRAP_TIMEOUT".into(), "600".into()));
    let q = queued(&told);
    assert_eq!(limit(&q).as_deref(), Some("600"));
    assert_eq!(q.env.len(), told.env.len(), "nothing added");
}

#[test]
fn bad_specs_are_refused() {
    assert!(launch_local(&JobSpec::new(0, 1, vec!["true".into()])).is_err());
    assert!(launch_local(&JobSpec::new(1, 1, vec![])).is_err());
    let err = launch_local(&JobSpec::new(1, 1, vec!["/no/such/program".into()])).unwrap_err();
    assert!(err.to_string().contains("/no/such/program"), "{err}");
}
