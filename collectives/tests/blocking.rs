//! The blocking front end, as a program without async uses it: three ranks, each a thread of
//! its own with its own communicator over TCP on 127.0.0.1, mixing blocking calls and calls
//! waited for later. The non-blocking calls are issued first and waited for last: they must
//! still pair up across ranks in the order they were made.

use std::thread;

use psnet_collectives::{node_of, BlockingCommunicator, CollectiveError, Config, ReduceOp};
use psnet_fallback_tcp::{TcpConfig, TcpTransport};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn rank(r: usize, n: usize, root: std::net::SocketAddr) -> Vec<f32> {
    let bind = move || async move {
        let addr = if r == 0 {
            root
        } else {
            "127.0.0.1:0".parse().unwrap()
        };
        TcpTransport::bind(node_of(r), TcpConfig::new(addr))
            .await
            .map_err(|e| CollectiveError::Transport(e.to_string()))
    };
    let comm = BlockingCommunicator::join(bind, r, n, root, Config::default()).expect("join");
    // Issued now, waited for at the end.
    let first = comm.allreduce_async(vec![r as f32; 1000], ReduceOp::Sum);
    let gathered = comm.allgather_async(vec![r as u8; 3]);
    let from_root = comm.broadcast_async(vec![r as i64 + 100; 10], 2);
    // Blocking calls in between.
    let mut big = vec![1.0f32; 300_000];
    comm.allreduce(&mut big, ReduceOp::Sum)
        .expect("blocking allreduce");
    assert!(big.iter().all(|&x| x == n as f32));
    comm.barrier().expect("barrier");
    let mut out = vec![0.0f32; 4];
    comm.reduce_into(&[r as f32; 4], &mut out, ReduceOp::Max, 0)
        .expect("reduce");
    if r == 0 {
        assert_eq!(out, vec![(n - 1) as f32; 4]);
    }
    assert_eq!(from_root.wait().expect("broadcast"), vec![102i64; 10]);
    let want: Vec<u8> = (0..n).flat_map(|x| [x as u8; 3]).collect();
    assert_eq!(gathered.wait().expect("allgather"), want);
    first.wait().expect("allreduce")
}

#[test]
fn blocking_and_waited_for_calls_pair_up_in_the_order_made() {
    let n = 3;
    let root = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let threads: Vec<_> = (0..n)
        .map(|r| thread::spawn(move || rank(r, n, root)))
        .collect();
    let want = vec![(0..n).sum::<usize>() as f32; 1000];
    for t in threads {
        assert_eq!(t.join().expect("rank thread"), want);
    }
}
