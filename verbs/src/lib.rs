//! psnet's RDMA transport.
//!
//! This version holds the part that needs neither libibverbs nor hardware: [`discovery`]
//! finds the RDMA device and port bound to a network interface by reading sysfs, which is how
//! psnet decides between RDMA and TCP. The verbs data path (queue pairs, registration cache,
//! eager and rendezvous protocols) comes with the verbs issue and implements the same
//! `psnet_transport::Transport` contract as the TCP transport.
#![deny(missing_docs)]

pub mod discovery;
