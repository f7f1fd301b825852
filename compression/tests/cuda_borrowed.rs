//! Device memory borrowed by raw pointer (feature `cuda`): a view of it reads and writes the
//! owner's memory, dropping the borrow leaves the memory allocated and as written, and ranges
//! whose ends the driver does not know as that device's memory are refused saying why. Without a GPU the
//! tests say why they skipped; the refusals' logic is unit-tested with fakes (`borrowed.rs`).
#![cfg(feature = "cuda")]

use psnet_compression::cuda::cudarc::driver::DevicePtr;
use psnet_compression::cuda::{context, device_count, BorrowedDevice};
use psnet_compression::CompressionError;

#[test]
fn without_a_device_borrowing_is_an_error_not_a_panic() {
    if device_count().is_ok() {
        return;
    }
    // SAFETY: refused before anything is touched (no device).
    let err = unsafe { BorrowedDevice::<f32>::new(0, 0x1000, 4) }.unwrap_err();
    assert!(matches!(err, CompressionError::NoCudaDevice(_)), "{err}");
}

#[test]
fn a_borrowed_range_reads_and_writes_the_owners_memory_and_is_never_freed() {
    if let Err(e) = device_count() {
        eprintln!(
            "a_borrowed_range_reads_and_writes_the_owners_memory_and_is_never_freed: skipped: {e}"
        );
        return;
    }
    let ctx = context(0).expect("context");
    let stream = ctx.default_stream();
    let values: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    let owner = stream.clone_htod(&values).expect("upload");
    let base = {
        let (ptr, _sync) = owner.device_ptr(&stream);
        ptr
    };
    stream.synchronize().expect("sync");
    for _ in 0..3 {
        // SAFETY: elements 100..1100 of `owner`, which outlives the borrow; nothing else
        // touches it meanwhile (one stream, synchronized).
        let mut borrowed = unsafe { BorrowedDevice::<f32>::new(0, base + 400, 1000) }
            .expect("a range inside the allocation");
        assert_eq!(borrowed.len(), 1000);
        let seen = stream.clone_dtoh(&borrowed.view()).expect("download");
        assert_eq!(seen, values[100..1100]);
        let doubled: Vec<f32> = seen.iter().map(|v| v * 2.0).collect();
        stream
            .memcpy_htod(&doubled, &mut borrowed.view_mut())
            .expect("write through the borrow");
        stream.synchronize().expect("sync");
    }
    // Written three times through three borrows, and still allocated.
    let after = stream
        .clone_dtoh(&owner)
        .expect("the owner's memory is still there");
    assert_eq!(after[..100], values[..100]);
    assert_eq!(after[1100..], values[1100..]);
    assert!(after[100..1100]
        .iter()
        .zip(&values[100..1100])
        .all(|(a, v)| *a == v * 8.0));

    let refused = |ptr: u64, len: usize, why: &str| {
        // SAFETY: each is refused by the driver check before anything is touched.
        let err = unsafe { BorrowedDevice::<f32>::new(0, ptr, len) }.unwrap_err();
        assert!(err.to_string().contains(why), "{ptr:#x}+{len}: {err}");
    };
    refused(base + 2, 4, "not aligned");
    // The last byte a terabyte past the allocation, where nothing is mapped.
    refused(base + 400, 1 << 38, "last byte");
    let on_host = values.as_ptr() as u64;
    refused(on_host, 4, "first byte");
    refused(1 << 12, 4, "");
    refused(u64::MAX - 7, 4, "end of the address space");
}
