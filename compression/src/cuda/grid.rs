//! The shape of psnet's kernel launches: a grid that fills the device, and grid-stride loops
//! in the kernels for the rest.

use std::sync::Arc;

use cudarc::driver::{CudaContext, LaunchConfig};

use super::{cuda_err, guard, BLOCKS_PER_SM, THREADS_PER_BLOCK};
use crate::error::CompressionError;

/// The largest grid psnet's kernels launch on `ctx`'s device: enough blocks to fill every
/// multiprocessor ([`BLOCKS_PER_SM`] each); grid-stride loops cover the rest.
pub(crate) fn max_blocks(ctx: &Arc<CudaContext>) -> Result<u32, CompressionError> {
    let sms = guard(|| {
        ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
    })
    .map_err(cuda_err("reading the multiprocessor count"))?;
    Ok(u32::try_from(sms).unwrap_or(1).max(1) * BLOCKS_PER_SM)
}

/// A launch of `threads` threads in blocks of [`THREADS_PER_BLOCK`], at most `max_blocks` of
/// them (the kernels' grid-stride loops cover the rest).
pub(crate) fn grid_stride(threads: u64, max_blocks: u32) -> LaunchConfig {
    let blocks = threads
        .div_ceil(u64::from(THREADS_PER_BLOCK))
        .clamp(1, u64::from(max_blocks));
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS_PER_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}
