//! Bad input against a live server, from a member of the job: a worker that registered and
//! holds its token (see `rogue/`), so that what it sends passes admission and reaches the
//! server. Each kind of bad request must get the sender a clear error naming the problem,
//! while the server goes on serving the honest worker, whose job ends with the right weights,
//! without a panic and without allocating what a header merely claims (`rogue/watch.rs`
//! counts every huge allocation of this process).
//!
//! What the sender gets (what a ps-lite user would expect, minus ps-lite's crash on malformed
//! input):
//! - A request whose metadata decodes but asks something wrong (sizes or counts, unknown key,
//!   push before init, extra data segments, compression or mode that disagree with the job)
//!   is answered `Failed` with the reason, naming the key and the sizes; nothing changes.
//! - Metadata that does not decode is answered `Failed` too: for the request id it starts
//!   with when that much is readable, else for request id 0 (`NO_REQUEST`), so a sender never
//!   waits on a message the server could not read. With `PS_RESEND` such a message still
//!   takes its sequence number (answered once, never resent); only an unreadable envelope
//!   cannot be answered.
//! - A frame longer than the server's `PSNET_MAX_MESSAGE` is refused by its transport from the
//!   header, before anything is allocated; a byte stream cannot be resynchronised, so that
//!   connection is closed, and the sender sees it lost. Without `PS_RESEND` a connection is
//!   the worker's membership: in `dist_sync` the others' rounds then fail naming it.
//! - A second registration by a member is refused by the scheduler, naming the member; a
//!   newcomer after assignment is refused at the door.

use psnet_compression::CompressionParams;
use psnet_kv::proto::ids::{Group, Role, SCHEDULER};
use psnet_kv::proto::msg::{CommandKind, Msg, PushFlags, VERSION};
use psnet_kv::updater::OptimizerSpec;
use psnet_kv::{KvError, Mode};
use psnet_transport::{Limits, NodeId, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;

mod rogue;

use rogue::job::{complete_round, end_round_and_job, honest_round, loopback, Job, Setup, KEY, LEN};
use rogue::watch::{peak_bytes, HUGE};
use rogue::{
    assert_names, compressed_push, f32_bytes, init_msg, packed_push, pull_msg, push_msg, refused,
    set_compression, two_bit, PATIENCE,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_value_counts_and_sizes_are_refused_naming_them() {
    let mut job = Job::start(Setup::default()).await;
    let (go, gate) = oneshot::channel();
    let honest = honest_round(&job, gate);
    job.rogue.barrier(Group::WORKERS).await;
    let s = job.server();
    let r = &mut job.rogue;
    let four = f32_bytes(&[2.0; LEN]);
    // Count and bytes agree with each other but not with the key.
    let e = refused(r.request(s, push_msg(KEY, 3), &[&four[..12]]).await);
    assert_names(&e, &["key 1", "pushed 3 elements", "holds 4"]);
    // The count is right, the bytes are not (keys and lengths disagree).
    let e = refused(r.request(s, push_msg(KEY, 4), &[&four[..12]]).await);
    assert_names(&e, &["key 1", "12 bytes", "expected 16"]);
    let e = refused(r.request(s, push_msg(KEY, 4), &[]).await);
    assert_names(&e, &["key 1", "0 bytes", "expected 16"]);
    // Two value segments where a push carries one: refused, not half-read.
    let hundreds = f32_bytes(&[100.0; LEN]);
    let e = refused(
        r.request(s, push_msg(KEY, 4), &[&hundreds, &hundreds])
            .await,
    );
    assert_names(&e, &["push", "2 data segment"]);
    // Pulls and commands carry no values.
    let e = refused(r.request(s, pull_msg(KEY, 8), &[]).await);
    assert_names(&e, &["key 1", "pulled 8 elements", "holds 4"]);
    let pull = pull_msg(KEY, 4);
    let e = refused(r.request(s, pull, &[&hundreds]).await);
    assert_names(&e, &["pull", "1 data segment"]);
    let mode = |ts| Msg::Command {
        ts,
        kind: CommandKind::SetMode,
        body: "sync".into(),
    };
    let e = refused(r.request(s, mode, &[&hundreds]).await);
    assert_names(&e, &["command", "1 data segment"]);
    // Inits whose count and values disagree store nothing.
    let e = refused(r.request(s, init_msg(2, 8), &[&four]).await);
    assert_names(&e, &["key 2", "announces 8 elements", "carries 4"]);
    let e = refused(r.request(s, init_msg(2, 4), &[&four[..15]]).await);
    assert_names(&e, &["key 2", "not float32 values"]);
    let e = refused(r.request(s, pull_msg(2, 4), &[]).await);
    assert_names(&e, &["key 2", "before it was initialized"]);
    end_round_and_job(job, go, honest).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_keys_and_pushes_before_init_are_refused() {
    let mut job = Job::start(Setup::default()).await;
    let s = job.server();
    // Before worker 0 initialized the key: refused, and the key is not created by it.
    let e = refused(job.rogue.push(s, KEY, &[2.0; LEN]).await);
    assert_names(&e, &["key 1", "pushed before it was initialized"]);
    let e = refused(job.rogue.request(s, pull_msg(KEY, 4), &[]).await);
    assert_names(&e, &["key 1", "pulled before it was initialized"]);
    let (go, gate) = oneshot::channel();
    let honest = honest_round(&job, gate);
    job.rogue.barrier(Group::WORKERS).await;
    // A key nobody ever initialized.
    let e = refused(job.rogue.push(s, 99, &[2.0; LEN]).await);
    assert_names(&e, &["key 99", "pushed before it was initialized"]);
    let e = refused(job.rogue.request(s, pull_msg(99, 4), &[]).await);
    assert_names(&e, &["key 99", "pulled before it was initialized"]);
    end_round_and_job(job, go, honest).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_claimed_counts_are_refused_without_allocating() {
    let mut job = Job::start(Setup {
        kv: |c| c.server_key_bytes(1 << 20),
        ..Setup::default()
    })
    .await;
    let (go, gate) = oneshot::channel();
    let honest = honest_round(&job, gate);
    job.rogue.barrier(Group::WORKERS).await;
    let s = job.server();
    let r = &mut job.rogue;
    let four = f32_bytes(&[2.0; LEN]);
    // Counts that would take gigabytes (or overflow) if anyone trusted them.
    for n in [1u64 << 28, 1 << 40, u64::MAX] {
        let e = refused(r.request(s, push_msg(KEY, n), &[&four]).await);
        assert_names(&e, &["key 1", &format!("pushed {n} elements"), "holds 4"]);
        let e = refused(r.request(s, init_msg(3, n), &[&four]).await);
        assert_names(
            &e,
            &["key 3", &format!("announces {n} elements"), "carries 4"],
        );
        let pull = pull_msg(KEY, n);
        let e = refused(r.request(s, pull, &[]).await);
        assert_names(&e, &["key 1", &format!("pulled {n} elements")]);
    }
    // Values that do arrive are bounded by the server's PSNET_KV_SERVER_KEY_BYTES
    // (`proto/server/tests.rs`); this rogue, worker 1, may not initialize keys at all.
    let big = vec![0u8; 2 << 20];
    let e = refused(r.request(s, init_msg(3, (2 << 20) / 4), &[&big]).await);
    assert_names(&e, &["key 3", "only worker 0 initializes"]);
    end_round_and_job(job, go, honest).await;
    assert!(
        peak_bytes() < HUGE,
        "the process held {} bytes at once",
        peak_bytes()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compression_that_disagrees_with_the_server_is_refused() {
    let mut job = Job::start(Setup::default()).await;
    let s = job.server();
    let grad = [0.6f32; LEN];
    let (go, gate) = oneshot::channel::<()>();
    let (compress, compress_gate) = oneshot::channel::<()>();
    let (compressing, compressing_gate) = oneshot::channel::<()>();
    let w = job.honest.clone();
    let honest = tokio::spawn(async move {
        w.init(&[KEY], &[&[0.0; LEN]]).await.expect("honest init");
        compress_gate.await.expect("compress");
        w.set_gradient_compression(CompressionParams::two_bit(0.5).unwrap())
            .await
            .expect("worker 0 sets 2-bit compression");
        compressing.send(()).unwrap();
        gate.await.expect("go");
        let mut out = vec![0.0; LEN];
        w.pushpull(KEY, &grad, &mut out).await.expect("the round");
        out
    });
    job.rogue.barrier(Group::WORKERS).await;
    // No compression set yet: compressed bytes are refused, not read as f32.
    let e = refused(
        job.rogue
            .request(s, compressed_push(4), &[&two_bit(0.5, &grad)])
            .await,
    );
    assert_names(&e, &["key 1", "no compression was set"]);
    compress.send(()).unwrap();
    compressing_gate.await.unwrap();
    let r = &mut job.rogue;
    // Settings that differ from the job's are refused, whatever the rogue wants.
    for other in [
        CompressionParams::two_bit(1.0).unwrap(),
        CompressionParams::one_bit(0.5).unwrap(),
        CompressionParams::None,
    ] {
        let e = refused(r.request(s, set_compression(other), &[]).await);
        assert_names(&e, &["compression", "already", &other.to_string()]);
    }
    // Through the API, too: the call fails and worker 0 keeps compressing as before.
    let e = job
        .honest
        .set_gradient_compression(CompressionParams::two_bit(1.0).unwrap())
        .await
        .unwrap_err();
    assert!(matches!(e, KvError::Remote { .. }), "{e}");
    assert_names(&e.to_string(), &["server 0 (node 8)", "already"]);
    let r = &mut job.rogue;
    // The same settings again are fine.
    let same = CompressionParams::two_bit(0.5).unwrap();
    assert_eq!(r.request(s, set_compression(same), &[]).await, Ok(None));
    // Bytes of the wrong length for the scheme are refused.
    let e = refused(r.request(s, compressed_push(4), &[&[0u8; 2]]).await);
    assert_names(&e, &["key 1", "compressed push of 2 bytes", "expected 4"]);
    // Packed codes that do not unpack to the key's codes are refused naming why: an unknown
    // form, a field past the end (4 elements: 4 bytes of codes, 16 fields), the raw form
    // of another length, a packed push of another element count than the key's.
    for (packed, n, why) in [
        (&[9u8, 1][..], 4, "unknown form 9"),
        (&[1, 0x41][..], 4, "run past 4 bytes"),
        (&[0, 1, 2][..], 4, "raw packed codes of 2 bytes"),
        (&[1][..], 5, "pushed 5 elements"),
        (&[0u8; 6][..], 4, "6 bytes of packed codes, at most 5"),
    ] {
        let e = refused(r.request(s, packed_push(n), &[packed]).await);
        assert_names(&e, &["key 1", why]);
    }
    // The rogue's compressed push waits in the round; a change now would decode it with
    // other settings than it was made with. Refused.
    let ts = r.ts();
    let mine = two_bit(0.5, &grad);
    r.send(s, &compressed_push(4)(ts), &[&mine]).await;
    let e = refused(
        r.request(s, set_compression(CompressionParams::None), &[])
            .await,
    );
    assert_names(&e, &["compression", "already"]);
    go.send(()).unwrap();
    assert_eq!(r.answer(s, ts).await, Ok(None));
    // 0.6 quantizes to +0.5 on both workers.
    assert_eq!(honest.await.unwrap(), vec![1.0; LEN]);
    assert!(job.server_running());
    job.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_that_would_strand_a_round_are_refused() {
    let mut job = Job::start(Setup::default()).await;
    let (go, gate) = oneshot::channel();
    let honest = honest_round(&job, gate);
    job.rogue.barrier(Group::WORKERS).await;
    let s = job.server();
    let r = &mut job.rogue;
    // The rogue's push waits in the round for worker 0's.
    let ts = r.ts();
    r.send(s, &push_msg(KEY, 4)(ts), &[&f32_bytes(&[2.0; LEN])])
        .await;
    // Switching to dist_async would leave the round (and worker 0's push) unanswered. A
    // mode is worker 0's to set: the rogue's waits for worker 0's (which never comes) and
    // changes nothing; the round below still completes. (Worker 0 switching mid-round is
    // refused: the server's unit tests.)
    let mode = r.ts();
    let switch = Msg::Command {
        ts: mode,
        kind: CommandKind::SetMode,
        body: "async".into(),
    };
    r.send(s, &switch, &[]).await;
    // Re-initializing the key would drop the pushes of its round.
    let e = refused(
        r.request(s, init_msg(KEY, 4), &[&f32_bytes(&[9.0; LEN])])
            .await,
    );
    assert_names(&e, &["key 1", "init", "round"]);
    // Init values are never compressed.
    let compressed_init = |ts| Msg::Push {
        ts,
        key: 5,
        flags: PushFlags {
            init: true,
            compressed: true,
            pull_back: false,
            retry: None,
            dtype: psnet_kv::Dtype::F32,
            have: None,
            packed: false,
        },
        n_elems: 4,
        priority: 0,
    };
    let e = refused(r.request(s, compressed_init, &[&[0u8; 16]]).await);
    assert_names(&e, &["key 5", "init", "compressed"]);
    go.send(()).unwrap();
    assert_eq!(r.answer(s, ts).await, Ok(None));
    assert_eq!(honest.await.unwrap(), vec![3.0; LEN]);
    job.finish().await;
}

/// MXNet's workers each send the optimizer, so a server takes another worker's only as
/// agreement with worker 0's. Before, the first one was applied, whoever sent it: a member
/// in worker 1's place set lr=1000 before worker 0 spoke, and in a job whose worker 0 sets
/// none, every round was then updated with it (exit 0, a wrong model).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_workers_optimizer_before_worker_0_spoke_changes_nothing() {
    let mut job = Job::start(Setup::default()).await;
    let (go, gate) = oneshot::channel();
    let honest = honest_round(&job, gate);
    job.rogue.barrier(Group::WORKERS).await;
    let s = job.server();
    let r = &mut job.rogue;
    let ts = r.ts();
    let wild = Msg::Command {
        ts,
        kind: CommandKind::SetOptimizer,
        body: r#"{"type":"sgd","learning_rate":1000}"#.into(),
    };
    r.send(s, &wild, &[]).await;
    // The round: without an optimizer the server keeps the sum, 1 + 2.
    go.send(()).unwrap();
    complete_round(&mut job, honest).await;
    job.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_metadata_is_answered_and_the_server_goes_on() {
    malformed_metadata(Setup::default(), false).await;
}

/// With `PS_RESEND`, metadata that does not decode inside a good envelope still takes its
/// sequence number: it is answered once, and nothing is resent or given up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_metadata_under_ps_resend_is_answered_once() {
    malformed_metadata(
        Setup {
            kv: |c| c.resend(Some(std::time::Duration::from_secs(2))),
            ..Setup::default()
        },
        true,
    )
    .await;
}

/// `resend`: `setup` turns `PS_RESEND` on.
async fn malformed_metadata(setup: Setup, resend: bool) {
    let mut job = Job::start(setup).await;
    let (go, gate) = oneshot::channel();
    let honest = honest_round(&job, gate);
    job.rogue.barrier(Group::WORKERS).await;
    let s = job.server();
    let r = &mut job.rogue;
    let four = f32_bytes(&[2.0; LEN]);
    // Metadata whose request id is readable: answered for that request.
    let ts = r.ts();
    let push = push_msg(KEY, 4)(ts).encode();
    let mut bad_flags = push.clone();
    bad_flags[18] = 0x30;
    let mut trailing = push.clone();
    trailing.push(0);
    let mut bad_utf8 = vec![VERSION, 10];
    bad_utf8.extend_from_slice(&ts.to_le_bytes());
    bad_utf8.extend_from_slice(&[1, 2, 0, 0, 0, 0xff, 0xfe]);
    let mut long_string = vec![VERSION, 10];
    long_string.extend_from_slice(&ts.to_le_bytes());
    long_string.push(0);
    long_string.extend_from_slice(&(1u32 << 20).to_le_bytes());
    for (meta, why) in [
        (&push[..20], "truncated"),
        (&bad_flags[..], "unknown value type"),
        (&trailing[..], "1 trailing bytes"),
        (&bad_utf8[..], "not UTF-8"),
        (&long_string[..], "longer than 64 KiB"),
    ] {
        r.send_raw(s, meta, &[&four]).await.unwrap();
        let e = refused(r.answer(s, ts).await);
        assert_names(&e, &["could not read", why]);
    }
    // Metadata without a readable request id: answered for request 0.
    let mut cases = vec![
        (&[0xde, 0xad, 0xbe, 0xef][..], "version 222"),
        (&[VERSION, 99][..], "tag 99"),
        (&[VERSION, 11, 1, 2][..], "truncated"),
    ];
    let envelope = [0xE1, 1, 1, 0, 0, 0, 0, 0, 0, 0, VERSION, 6];
    if !resend {
        // Under PS_RESEND an envelope cannot be empty or hold another one: such a frame has
        // no sequence number to take, and its sender is given up after the resend limit.
        cases.extend([(&[][..], "truncated"), (&envelope[..], "PS_RESEND")]);
    }
    for (meta, why) in cases {
        r.send_raw(s, meta, &[]).await.unwrap();
        let e = refused(r.answer(s, 0).await);
        assert_names(&e, &["could not read", why]);
    }
    // The scheduler, whose messages have no request ids, answers for request 0 as well.
    r.send_raw(SCHEDULER, &[VERSION, 3, 0], &[]).await.unwrap();
    let e = refused(r.answer(SCHEDULER, 0).await);
    assert_names(&e, &["scheduler could not read", "bad group"]);
    end_round_and_job(job, go, honest).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_registration_is_refused_and_the_job_goes_on() {
    let job = Job::start(Setup::default()).await;
    let (go, gate) = oneshot::channel();
    let honest = honest_round(&job, gate);
    job.rogue.barrier(Group::WORKERS).await;
    let me = job.rogue.id;
    let addr = job.rogue.t.listen_addr();
    // A member registers again, as a worker (its own rank or another) or as a server.
    for (role, hint) in [
        (Role::Worker, Some(1)),
        (Role::Worker, Some(0)),
        (Role::Server, None),
    ] {
        let again = Msg::Register {
            role,
            addr,
            rank_hint: hint,
            recovery: None,
            identity: psnet_transport::Identity::from_seed([1; 32]).public(),
        };
        job.rogue.send(SCHEDULER, &again, &[]).await;
        let (from, msg, _) = job.rogue.next().await;
        assert_eq!(from, SCHEDULER);
        match msg {
            Msg::NodeFailed { id, reason } => {
                assert_eq!(id, me);
                assert_names(&reason, &["worker 1 (node 11)", "already registered"]);
            }
            other => panic!("a second registration answered with {other:?}"),
        }
    }
    // A newcomer cannot register once every node is assigned: refused at the door.
    let late = psnet_fallback_tcp::TcpTransport::bind(NodeId(0), loopback())
        .await
        .unwrap();
    late.set_local_id(psnet_kv::proto::ids::provisional_id(late.listen_addr()));
    let root = job.rogue.addr_of(SCHEDULER);
    let e = late.connect(SCHEDULER, root).await.unwrap_err();
    assert_names(&e.to_string(), &["registrations are closed"]);
    end_round_and_job(job, go, honest).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_frames_are_refused_by_the_servers_listener() {
    const SERVER_MAX: u64 = 1 << 20;
    let mut server = loopback();
    server.limits = Limits {
        max_message: SERVER_MAX,
        ..Limits::default()
    };
    // The rogue's own limit is larger, and it sends over the socket (no shared ring).
    let mut rogue = loopback();
    rogue.shm_ring = 0;
    let job = Job::start(Setup {
        kv: |c| c,
        server,
        rogue,
    })
    .await;
    let s = job.server();
    let w = job.honest.clone();
    let honest = tokio::spawn(async move {
        w.set_mode(Mode::Async).await?;
        let sgd = OptimizerSpec::parse(r#"{"type":"sgd","learning_rate":1.0}"#).unwrap();
        w.set_optimizer(&sgd).await?;
        w.init(&[KEY], &[&[0.0; LEN]]).await?;
        Ok::<_, KvError>(())
    });
    job.rogue.barrier(Group::WORKERS).await;
    honest.await.unwrap().expect("worker 0 sets up the job");
    // A push of 2 MiB to a server that takes at most 1 MiB per message.
    let big = vec![0u8; 2 << 20];
    let meta = push_msg(KEY, (2 << 20) / 4)(1).encode();
    let _ = job.rogue.send_raw(s, &meta, &[&big]).await;
    let why = job.rogue.wait_lost(s).await;
    tracing::info!(%why, "the rogue's connection to the server was closed");
    // A stranger's oversize frame, before any hello: the listener closes the socket.
    let mut raw = tokio::net::TcpStream::connect(job.rogue.addr_of(s))
        .await
        .unwrap();
    let mut header = b"PN".to_vec();
    header.extend_from_slice(&[psnet_transport::codec::VERSION, 0]);
    header.extend_from_slice(&1u16.to_le_bytes());
    header.extend_from_slice(&0u16.to_le_bytes());
    header.extend_from_slice(&0u32.to_le_bytes());
    header.extend_from_slice(&(1u64 << 40).to_le_bytes());
    raw.write_all(&header).await.unwrap();
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(PATIENCE, async {
        loop {
            match raw.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the server kept a socket that sent an oversize frame"
    );
    // The server serves worker 0 as before.
    assert!(job.server_running());
    let w = &job.honest;
    w.push(KEY, &[1.0; LEN])
        .await
        .expect("push after the bad frames");
    let mut out = vec![0.0; LEN];
    w.pull(KEY, &mut out)
        .await
        .expect("pull after the bad frames");
    assert_eq!(out, vec![-1.0; LEN]);
    job.finish().await;
    assert!(
        peak_bytes() < HUGE,
        "the process held {} bytes at once",
        peak_bytes()
    );
}

/// The second hardening round: every `Assign` carried every node's token, so a member could
/// dial a server as worker 0 (and `init` or set the optimizer as it), or as the scheduler
/// (and send `Shutdown`). A member now holds only the others' public identities (each node
/// draws its own and registers the public half): a proof it signs for their ids does not
/// pass as theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_cannot_speak_as_another_member_or_the_scheduler() {
    use psnet_transport::codec::{self, DataPath};
    use psnet_transport::{FrameKind, OutMessage};
    let job = Job::start(Setup::default()).await;
    let (go, gate) = oneshot::channel();
    let honest = honest_round(&job, gate);
    job.rogue.barrier(Group::WORKERS).await;
    let server = job.rogue.servers()[0];
    let target = job.rogue.addr_of(server);
    let worker0 = psnet_kv::proto::ids::node_id(Role::Worker, 0);
    for id in [worker0, SCHEDULER] {
        let binding = psnet_transport::Binding::new(None, psnet_transport::session::Role::Dialler);
        let forged = psnet_transport::Identity::from_seed(job.rogue.seed).prove(id, &binding);
        let hello = codec::encode_hello_proved(id, DataPath::Tcp, Some(&forged));
        let frame = codec::encode_frame(
            FrameKind::Hello,
            &OutMessage::new(&hello, &[]),
            &Limits::default(),
        )
        .unwrap();
        let mut s = tokio::net::TcpStream::connect(target).await.unwrap();
        s.write_all(&frame).await.unwrap();
        let mut buf = bytes::BytesMut::new();
        let answer = loop {
            if let Some(f) = codec::decode_frame(&mut buf, &Limits::default()).unwrap() {
                break f;
            }
            let read =
                tokio::time::timeout(std::time::Duration::from_secs(10), s.read_buf(&mut buf))
                    .await
                    .expect("an answer to the hello")
                    .unwrap();
            assert!(read > 0, "closed without an answer");
        };
        assert_eq!(answer.kind, FrameKind::HelloReject, "{id:?} was let in");
        assert_names(
            &String::from_utf8_lossy(&answer.meta),
            &["not its identity's"],
        );
    }
    end_round_and_job(job, go, honest).await;
}
