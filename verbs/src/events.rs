//! What psnet does about a device's asynchronous events (`ibv_get_async_event`): a port going
//! down, a device failing or a queue pair breaking becomes a per-peer error at once, naming
//! the device and the event, instead of a stall until retries run out. Plain logic: the FFI
//! that reads the events is in the crate's `sys` module.

/// An asynchronous event of a device (`ibv_get_async_event`), already acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AsyncEvent {
    /// The `ibv_event_type` value.
    pub code: u32,
    /// The queue pair number, for events about a queue pair.
    pub qp_num: Option<u32>,
    /// The port, for events about a port.
    pub port: Option<u8>,
}

/// What an asynchronous event code is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// One queue pair.
    QueuePair,
    /// One port.
    Port,
    /// The whole device (or its completion queue).
    Device,
    /// Shared receive queues and work queues, which psnet does not use; or unknown.
    Other,
}

/// The scope of event `code` (values of `enum ibv_event_type`).
pub fn scope(code: u32) -> Scope {
    match code {
        1..=7 | 16 => Scope::QueuePair,
        9..=13 | 17 | 18 | 20 => Scope::Port,
        0 | 8 => Scope::Device,
        _ => Scope::Other,
    }
}

/// The name of event `code`, as rdma-core spells it.
pub fn name(code: u32) -> &'static str {
    const NAMES: [&str; 21] = [
        "IBV_EVENT_CQ_ERR",
        "IBV_EVENT_QP_FATAL",
        "IBV_EVENT_QP_REQ_ERR",
        "IBV_EVENT_QP_ACCESS_ERR",
        "IBV_EVENT_COMM_EST",
        "IBV_EVENT_SQ_DRAINED",
        "IBV_EVENT_PATH_MIG",
        "IBV_EVENT_PATH_MIG_ERR",
        "IBV_EVENT_DEVICE_FATAL",
        "IBV_EVENT_PORT_ACTIVE",
        "IBV_EVENT_PORT_ERR",
        "IBV_EVENT_LID_CHANGE",
        "IBV_EVENT_PKEY_CHANGE",
        "IBV_EVENT_SM_CHANGE",
        "IBV_EVENT_SRQ_ERR",
        "IBV_EVENT_SRQ_LIMIT_REACHED",
        "IBV_EVENT_QP_LAST_WQE_REACHED",
        "IBV_EVENT_CLIENT_REREGISTER",
        "IBV_EVENT_GID_CHANGE",
        "IBV_EVENT_WQ_FATAL",
        "IBV_EVENT_DEVICE_SPEED_CHANGE",
    ];
    NAMES.get(code as usize).copied().unwrap_or("unknown event")
}

/// What to do about one event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Fail the link whose queue pair has this number.
    FailQueuePair {
        /// The queue pair.
        qp_num: u32,
        /// Why, for the peer-lost event.
        reason: String,
    },
    /// Fail every link on the device.
    FailAll(String),
    /// The queue pair with this number received its first message (`IBV_EVENT_COMM_EST`):
    /// its peer is connected, even if the connection manager has not said so yet (its last
    /// message, the RTU, may have been lost).
    Established {
        /// The queue pair.
        qp_num: u32,
    },
    /// Only log: nothing is broken.
    Log {
        /// Whether it deserves a warning rather than an info line.
        warn: bool,
        /// What to log.
        message: String,
    },
}

/// The action for `event` on device `device`, whose port in use is `port`.
pub fn decide(device: &str, port: u8, event: &AsyncEvent) -> Action {
    let what = name(event.code);
    let log = |warn: bool, message: String| Action::Log { warn, message };
    match (scope(event.code), event.code) {
        // QP_FATAL, QP_REQ_ERR, QP_ACCESS_ERR, PATH_MIG_ERR: the queue pair is in error.
        (Scope::QueuePair, 1 | 2 | 3 | 7) => match event.qp_num {
            Some(qp_num) => Action::FailQueuePair {
                qp_num,
                reason: format!(
                    "RDMA device {device} reported {what} on the queue pair to this peer"
                ),
            },
            None => log(true, format!("{what} on {device} without a queue pair")),
        },
        (Scope::QueuePair, 4) if event.qp_num.is_some() => Action::Established {
            qp_num: event.qp_num.unwrap_or_default(),
        },
        (Scope::QueuePair, _) => log(
            false,
            format!("{what} on {device} (queue pair {:?})", event.qp_num),
        ),
        (Scope::Port, code) if event.port != Some(port) => log(
            code == 10,
            format!(
                "{what} on {device} port {:?}, which psnet does not use (port {port})",
                event.port
            ),
        ),
        (Scope::Port, 10) => Action::FailAll(format!(
            "RDMA device {device} port {port} went down ({what})"
        )),
        (Scope::Port, 9) => log(
            false,
            format!("RDMA device {device} port {port} is active ({what})"),
        ),
        (Scope::Port, _) => log(true, format!("RDMA device {device} port {port}: {what}")),
        (Scope::Device, 0) => Action::FailAll(format!(
            "the completion queue on RDMA device {device} overflowed ({what})"
        )),
        (Scope::Device, _) => Action::FailAll(format!("RDMA device {device} failed ({what})")),
        (Scope::Other, _) => log(true, format!("{what} on {device} (event {})", event.code)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(code: u32, qp_num: Option<u32>, port: Option<u8>) -> AsyncEvent {
        AsyncEvent { code, qp_num, port }
    }

    #[test]
    fn broken_queue_pairs_fail_their_link_only() {
        for code in [1, 2, 3, 7] {
            match decide("mlx5_0", 1, &ev(code, Some(77), None)) {
                Action::FailQueuePair { qp_num, reason } => {
                    assert_eq!(qp_num, 77);
                    assert!(
                        reason.contains("mlx5_0") && reason.contains(name(code)),
                        "{reason}"
                    );
                }
                other => panic!("{}: {other:?}", name(code)),
            }
        }
        assert_eq!(
            decide("d", 1, &ev(4, Some(9), None)),
            Action::Established { qp_num: 9 }
        );
        for code in [5, 6, 16] {
            assert!(matches!(
                decide("d", 1, &ev(code, Some(1), None)),
                Action::Log { warn: false, .. }
            ));
        }
    }

    #[test]
    fn our_port_going_down_fails_everything_and_other_ports_do_not() {
        assert_eq!(
            decide("rxe0", 1, &ev(10, None, Some(1))),
            Action::FailAll("RDMA device rxe0 port 1 went down (IBV_EVENT_PORT_ERR)".into())
        );
        assert!(matches!(
            decide("rxe0", 1, &ev(10, None, Some(2))),
            Action::Log { warn: true, .. }
        ));
        assert!(matches!(
            decide("rxe0", 1, &ev(9, None, Some(1))),
            Action::Log { warn: false, .. }
        ));
        assert!(matches!(
            decide("rxe0", 1, &ev(18, None, Some(1))),
            Action::Log { warn: true, .. }
        ));
    }

    #[test]
    fn device_failures_fail_everything_and_unknown_codes_are_named() {
        for code in [0, 8] {
            match decide("rxe0", 1, &ev(code, None, None)) {
                Action::FailAll(reason) => assert!(reason.contains(name(code)), "{reason}"),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(name(99), "unknown event");
        assert_eq!(scope(99), Scope::Other);
        assert!(matches!(
            decide("rxe0", 1, &ev(99, None, None)),
            Action::Log { warn: true, .. }
        ));
    }

    #[test]
    fn every_known_code_has_its_rdma_core_name() {
        assert_eq!(name(0), "IBV_EVENT_CQ_ERR");
        assert_eq!(name(10), "IBV_EVENT_PORT_ERR");
        assert_eq!(name(20), "IBV_EVENT_DEVICE_SPEED_CHANGE");
        assert_eq!(scope(16), Scope::QueuePair);
        assert_eq!(scope(17), Scope::Port);
    }
}
