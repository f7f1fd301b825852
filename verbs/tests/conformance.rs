//! The transport conformance suite over real verbs. It runs where an RDMA device exists (the
//! Soft-RoCE guest of `scripts/rxe-vm`, which sets `RXE_DEV` and `RXE_ADDR`) and prints
//! SKIPPED with the reason elsewhere.

mod common;

psnet_transport::conformance_tests!(common::VerbsFactory::from_env());
