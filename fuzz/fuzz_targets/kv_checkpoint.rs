//! A kv server's durable shard (`psnet_kv::proto::server` snapshots and journal records,
//! `psnet_kv::checkpoint`'s journal file): what a restarted server reads back from
//! `PSNET_CHECKPOINT_DIR`, damaged by a crash or by anything else that writes there.
//!
//! Input: `mode u8 | bytes`; mode bit 0 clear: `bytes` is a snapshot and then journal
//! records; set: `bytes` is a journal file.
//!
//! Invariants: nothing panics; a snapshot that restores snapshots again to the same bytes
//! (checked inside `fuzz_decode`); decoding allocates in proportion to the input, not to the
//! lengths it claims.
#![no_main]

use libfuzzer_sys::fuzz_target;
use psnet_fuzz::{largest_allocation, Input, TrackingAlloc};

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mode = input.u8();
    let bytes = input.rest();
    let ((), largest) = largest_allocation(|| {
        if mode & 1 == 0 {
            psnet_kv::proto::server::fuzz_decode(bytes);
        } else {
            psnet_kv::checkpoint::fuzz_journal_file(bytes);
        }
    });
    // The states built beside the input (a 64-byte key, optimizer state) and the input's own
    // copies; never what its lengths claim.
    assert!(
        largest <= 64 * bytes.len() + (1 << 20),
        "{largest} bytes allocated at once for {} bytes of input",
        bytes.len()
    );
});
