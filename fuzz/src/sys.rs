//! The one `unsafe` of the fuzz crate: a global allocator that forwards to the system's and
//! records the largest single request, so targets can check that a decoder's allocations are
//! bounded by its limits and its input rather than by lengths the input claims.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

static LARGEST: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, recording the largest request. Install it in a target with
/// `#[global_allocator] static A: TrackingAlloc = TrackingAlloc;`.
pub struct TrackingAlloc;

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the only
// addition is an atomic maximum, which neither allocates nor touches the memory.
unsafe impl GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Runs `f` and returns its result with the largest single allocation made meanwhile (by any
/// thread) through [`TrackingAlloc`]; 0 where it is not the global allocator.
pub fn largest_allocation<R>(f: impl FnOnce() -> R) -> (R, usize) {
    LARGEST.store(0, Ordering::Relaxed);
    let r = f();
    (r, LARGEST.swap(0, Ordering::Relaxed))
}
