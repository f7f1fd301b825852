//! psnet's RDMA transport.
//!
//! This version holds device discovery: [`discovery`] finds the RDMA device and port bound to
//! a network interface by reading sysfs (how psnet decides between RDMA and TCP), and
//! [`devices`] lists what libibverbs reports, loading it at run time so that the same binary
//! starts on hosts without rdma-core. The verbs data path (queue pairs, registration cache,
//! eager and rendezvous protocols) comes with the verbs issue and implements the same
//! `psnet_transport::Transport` contract as the TCP transport.
#![deny(missing_docs)]

pub mod devices;
pub mod discovery;
