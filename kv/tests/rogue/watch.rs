//! The test process's allocator: the system's, with the peak of the bytes it held at once
//! tracked (the `cap` crate). These jobs need little memory; a server that trusted a count
//! from a header would allocate for it, and the peak would show it.

use std::alloc::System;

use cap::Cap;

/// A peak this large is a failure: nothing in these jobs needs it, and a server that trusted
/// a header's count (2^28 elements and up) would reach it.
pub const HUGE: usize = 256 << 20;

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

/// The most bytes this whole test process held at once so far.
pub fn peak_bytes() -> usize {
    ALLOCATOR.max_allocated()
}
