//! Joining a job: registration with the scheduler, the node table, connections to the servers and the worker's tasks.

use super::*;

impl<T: Transport> Worker<T> {
    /// Joins the job described by `config` (its role must be worker) over `transport` (bound
    /// and listening; the `psnet` crate binds one from the environment). Needs a tokio
    /// runtime.
    pub async fn join(config: &KvConfig, transport: T) -> Result<Worker<T>, KvError> {
        if config.role != Role::Worker {
            return Err(KvError::Invalid(format!(
                "Worker::join with role {}",
                config.role
            )));
        }
        psnet_recorder::install_signal_dump();
        let joined = bootstrap::join(config, transport).await?;
        let placement = Placement::new(joined.servers().len(), config.bigarray_bound)
            .map_err(|e| KvError::Invalid(e.to_string()))?;
        let (servers, num_workers) = (joined.servers(), joined.num_workers());
        let mut state = WorkerState::new(
            joined.rank,
            servers.clone(),
            num_workers,
            placement,
            config.heartbeat_timeout,
            crate::clock::now(),
        )
        .with_recovery(config.recovery_timeout.is_some())
        .with_partition_bytes(partition_bytes(config, &joined.nodes))
        .with_priorities(config.priorities);
        let partitions = partition_bytes(config, &joined.nodes) > 0;
        if partitions && config.partition_bytes.is_none() {
            state = state
                .with_pull_partition_bytes(crate::config::DEFAULT_COMPRESSED_PULL_PARTITION_BYTES);
        }
        let pack_codes = config
            .pack_codes
            .unwrap_or_else(|| spans_hosts(&joined.nodes));
        let shared = Arc::new(Shared {
            link: joined.link,
            admission: joined.admission,
            rank: joined.rank,
            gates: servers.iter().map(|_| Default::default()).collect(),
            servers,
            num_workers,
            state: Mutex::new(state),
            serial_sends: config.serial_sends,
            partitions,
            pack_codes,
            ended: Notify::new(),
            recorder: psnet_recorder::Recorder::with(
                psnet_recorder::Scope::Kv {
                    role: "worker".into(),
                    rank: joined.rank,
                    job: crate::checkpoint::JobId::of(&joined.nodes)
                        .map_or_else(String::new, |j| j.to_string()),
                },
                &config.recorder,
            ),
        });
        for event in joined.early {
            shared.handle(event);
        }
        let receiver = {
            let shared = shared.clone();
            tokio::spawn(async move {
                loop {
                    shared.state().handle_waiting(crate::clock::now(), true);
                    let Ok(event) = shared.link.recv().await else {
                        break;
                    };
                    shared.state().handle_waiting(crate::clock::now(), false);
                    // Said before the calls fail: the application may exit right after.
                    let tell = shared.state().leaving_before(&event);
                    shared.tell(tell).await;
                    if let Received::Msg {
                        from: SCHEDULER,
                        msg: Msg::Rejoined { node },
                        ..
                    } = &event
                    {
                        shared.reconnect(node).await;
                    }
                    shared.handle(event);
                }
                shared.state().handle_closed();
            })
        };
        let heartbeat = {
            let shared = shared.clone();
            let period = heartbeat_period(config);
            let enabled = config.heartbeat_interval.is_some();
            tokio::spawn(async move {
                if !enabled {
                    return;
                }
                let mut tick = tokio::time::interval(period);
                loop {
                    tick.tick().await;
                    let silence = shared.state().scheduler_silence(crate::clock::now());
                    if let Some(reason) = &silence {
                        // Said before the calls fail: the application may exit right after.
                        let tell = shared.state().leaving(SCHEDULER, reason);
                        shared.tell(tell).await;
                    }
                    let (ended, lost) = {
                        let mut state = shared.state();
                        if let Some(reason) = silence {
                            state.handle_lost(SCHEDULER, reason);
                        }
                        (state.is_shutdown(), state.scheduler_lost().is_some())
                    };
                    if lost {
                        shared.ended.notify_one();
                    }
                    if ended || lost {
                        break;
                    }
                    // A stopped scheduler stops reading: the send must not hold up the check.
                    let send = shared.link.send(SCHEDULER, &Msg::Heartbeat, None);
                    if let Ok(Err(_)) = tokio::time::timeout(period, send).await {
                        break;
                    }
                }
            })
        };
        tracing::info!(rank = shared.rank, "worker ready");
        Ok(Worker {
            shared,
            tasks: vec![receiver, heartbeat],
        })
    }
}
