//! The test process's allocator: the system's, counting allocations so large that nothing in
//! these jobs needs one. A server that trusted a count from a header would make one.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// An allocation at least this large is a failure: nothing in these jobs needs one, and a
/// server that trusted a header's count would make one.
pub const HUGE: usize = 256 << 20;
/// Allocations of at least [`HUGE`] bytes, in this whole test process.
static HUGE_ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting huge allocations.
struct Watch;

fn watch(size: usize) {
    if size >= HUGE {
        HUGE_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Watch {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        watch(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        watch(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        watch(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Watch = Watch;

/// How many allocations of at least [`HUGE`] bytes this process made so far.
pub fn huge_allocations() -> usize {
    HUGE_ALLOCATIONS.load(Ordering::Relaxed)
}
