//! The blocking front end from plain threads, against a job whose scheduler and servers run
//! in a background runtime.

use std::time::Duration;

use psnet_fallback_tcp::{TcpConfig, TcpTransport};
use psnet_kv::blocking::KvStore;
use psnet_kv::proto::ids::SCHEDULER;
use psnet_kv::{run_server, KvConfig, KvError, Role, Scheduler};
use psnet_transport::NodeId;

async fn tcp(id: NodeId) -> Result<TcpTransport, KvError> {
    Ok(TcpTransport::bind(id, TcpConfig::new("127.0.0.1:0".parse().unwrap())).await?)
}

#[test]
fn blocking_and_handle_forms_from_plain_threads() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let config = |role, root| {
        KvConfig::local(role, root, 1, 2)
            .heartbeats(
                Some(Duration::from_millis(200)),
                Some(Duration::from_secs(5)),
            )
            .bootstrap_timeout(Duration::from_secs(30))
    };
    let scheduler = Scheduler::new(
        &config(Role::Scheduler, "127.0.0.1:0".parse().unwrap()),
        rt.block_on(tcp(SCHEDULER)).unwrap(),
    );
    let root = scheduler.addr();
    let sched = rt.spawn(scheduler.run());
    let server_cfg = config(Role::Server, root);
    let server = rt.spawn(async move { run_server(&server_cfg, tcp(NodeId(0)).await?).await });
    let workers: Vec<_> = (0..2)
        .map(|_| {
            let cfg = config(Role::Worker, root);
            std::thread::spawn(move || -> Result<Vec<f32>, String> {
                let kv = KvStore::join(&cfg, || tcp(NodeId(0))).map_err(|e| e.to_string())?;
                let key = kv.key("weights");
                kv.init(&[key], &[&[0.0; 6]]).map_err(|e| e.to_string())?;
                let r = kv.rank() as f32 + 1.0;
                // Non-blocking push, then wait on its handle.
                let h = kv.push_async(key, vec![r; 6]);
                h.wait().map_err(|e| e.to_string())?;
                let pulled = kv
                    .pull_async(key, vec![0.0; 6])
                    .wait()
                    .map_err(|e| e.to_string())?;
                let mut out = vec![0.0; 6];
                kv.pushpull(key, &[1.0; 6], &mut out)
                    .map_err(|e| e.to_string())?;
                assert_eq!(out, vec![2.0; 6], "the second round's sum");
                kv.finalize().map_err(|e| e.to_string())?;
                Ok(pulled)
            })
        })
        .collect();
    for w in workers {
        assert_eq!(w.join().unwrap().expect("worker"), vec![3.0f32; 6]);
    }
    rt.block_on(async {
        server.await.unwrap().expect("server ends cleanly");
        sched.await.unwrap().expect("scheduler ends cleanly");
    });
}
