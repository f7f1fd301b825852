/// What a transport can do, so that callers choose paths from a description rather than from
/// the transport's name (UCX's lesson).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Short name for logs and reports: `"tcp"`, `"rdma"`.
    pub name: &'static str,
    /// Largest message (metadata plus all segments) in bytes.
    pub max_message: u64,
    /// Largest metadata block in bytes.
    pub max_meta: u32,
    /// Most data segments in one message.
    pub max_segments: u16,
    /// Peers on this host are reached through shared memory: a message costs copies, not a
    /// trip through the kernel's network stack, so latency-bound algorithms with fewer steps
    /// pay off to larger sizes.
    pub same_host_shm: bool,
}
