//! The launcher's output: every line of every process behind `[role rank] `, the numbering
//! the processes are given as their wished kv ranks (`DMLC_WORKER_ID` / `DMLC_SERVER_ID`).

use std::process::Command;

fn launch(args: &[&str], script: &str) -> (String, String, Option<i32>) {
    let out = Command::new(env!("CARGO_BIN_EXE_psnet-launch"))
        .args(args)
        .args(["--", "sh", "-c", script])
        .output()
        .expect("run psnet-launch");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.code(),
    )
}

#[test]
fn every_line_carries_its_process_role_and_rank() {
    let script = r#"echo "out ${DMLC_WORKER_ID:-${DMLC_SERVER_ID:--}}"; echo "err $DMLC_ROLE" >&2; printf 'no newline'"#;
    let (stdout, stderr, code) = launch(&["-n", "2", "-s", "1"], script);
    assert_eq!(code, Some(0), "{stderr}");
    let mut out: Vec<&str> = stdout.lines().collect();
    out.sort_unstable();
    assert_eq!(
        out,
        [
            "[scheduler] no newline",
            "[scheduler] out -",
            "[server 0] no newline",
            "[server 0] out 0",
            "[worker 0] no newline",
            "[worker 0] out 0",
            "[worker 1] no newline",
            "[worker 1] out 1",
        ]
    );
    let mut err: Vec<&str> = stderr.lines().collect();
    err.sort_unstable();
    assert_eq!(
        err,
        [
            "[scheduler] err scheduler",
            "[server 0] err server",
            "[worker 0] err worker",
            "[worker 1] err worker",
        ]
    );
}

#[test]
fn without_prefixes_the_output_is_untouched() {
    let (stdout, _, code) = launch(&["-n", "1", "-s", "1", "--no-prefix"], "echo plain");
    assert_eq!(code, Some(0));
    assert_eq!(stdout.lines().collect::<Vec<_>>(), ["plain"; 3]);
}

#[test]
fn the_failing_process_is_named_by_the_same_numbering() {
    let script = r#"if [ "${DMLC_WORKER_ID:-}" = 1 ]; then echo "worker one fails" >&2; exit 7; fi; sleep 30"#;
    let (_, stderr, code) = launch(&["-n", "2", "-s", "1", "--grace", "1"], script);
    assert_eq!(
        code,
        Some(7),
        "the launcher exits with the failing process's code"
    );
    assert!(stderr.contains("[worker 1] worker one fails"), "{stderr}");
    assert!(
        stderr.contains("psnet-launch: worker 1 failed first (exit status: 7)"),
        "{stderr}"
    );
}

#[test]
fn misuse_is_refused_before_anything_starts_with_what_to_do() {
    let cases: [(&[&str], &str); 4] = [
        (&["-n", "0"], "at least one server and one worker"),
        (&["-n", "1", "-H", "hosts"], "need --launcher ssh or mpi"),
        (&["-n", "1", "--launcher", "ssh"], "needs --hostfile"),
        (
            &["-n", "1", "--launcher", "mpi", "-H", "/no/such/hostfile"],
            "/no/such/hostfile",
        ),
    ];
    for (args, says) in cases {
        let (stdout, stderr, code) = launch(args, "echo started");
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stdout.contains("started"), "{args:?} started processes");
    }
}
