//! Half-precision (`f16`, `bf16`) GPU buffers: keys initialized with a half type (see
//! [`crate::value`]) pushed from and pulled into device memory of that type. Servers sum in
//! `f32` and store the key's own type, as for host pushes, so results are the bits host pushes
//! of the same values give. Gradient compression takes `f32` values only, on the GPU as on the
//! CPU: a half push with compression on is refused with the CPU path's error.

use psnet_compression::cuda::cudarc::driver::{
    CudaView, CudaViewMut, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};
use psnet_compression::cuda::{guarded, pinned_zeroed};
use psnet_transport::Transport;

use super::{gpu_err, same_len, GpuKv};
use crate::error::KvError;
use crate::value::{bf16, f16, Value};

/// A half-precision element type a GPU buffer may hold: `f16` or `bf16`.
pub trait HalfValue: Value + DeviceRepr + ValidAsZeroBits + sealed::Sealed {}

impl HalfValue for f16 {}
impl HalfValue for bf16 {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::f16 {}
    impl Sealed for super::bf16 {}
}

impl<T: Transport> GpuKv<'_, T> {
    /// Pushes the half-precision device buffer `values` for `key`, sent from the device (see
    /// [`crate::Worker::push_device`]).
    pub async fn push_half<H: HalfValue>(
        &self,
        key: u64,
        values: &CudaView<'_, H>,
    ) -> Result<(), KvError> {
        let bytes = self.stager.bytes(values);
        self.worker.push_device::<H>(key, &bytes).await
    }

    /// Pulls the half-precision key `key` into the device buffer `out`.
    pub async fn pull_half<H: HalfValue>(
        &self,
        key: u64,
        out: &mut CudaViewMut<'_, H>,
    ) -> Result<(), KvError> {
        let mut pinned = self.take_half_staging(key, out.len() * std::mem::size_of::<H>())?;
        let result = async {
            let host = halves::<H>(&mut pinned)?;
            self.worker.pull(key, host).await?;
            self.upload_half(host, out)
        }
        .await;
        self.put_half_staging(key, pinned);
        result
    }

    /// Pushes `values` and pulls the updated value into `out` (half precision), in one
    /// exchange per server.
    pub async fn pushpull_half<H: HalfValue>(
        &self,
        key: u64,
        values: &CudaView<'_, H>,
        out: &mut CudaViewMut<'_, H>,
    ) -> Result<(), KvError> {
        same_len(key, values.len(), out.len())?;
        let mut pinned = self.take_half_staging(key, out.len() * std::mem::size_of::<H>())?;
        let result = async {
            let host = halves::<H>(&mut pinned)?;
            let bytes = self.stager.bytes(values);
            self.worker.pushpull_device::<H>(key, &bytes, host).await?;
            self.upload_half(host, out)
        }
        .await;
        self.put_half_staging(key, pinned);
        result
    }

    fn take_half_staging(&self, key: u64, bytes: usize) -> Result<PinnedHostSlice<u8>, KvError> {
        if let Some(s) = self.device().half_staging.remove(&key) {
            if s.len() == bytes {
                return Ok(s);
            }
        }
        pinned_zeroed(&self.ctx, bytes).map_err(gpu_err)
    }

    fn put_half_staging(&self, key: u64, pinned: PinnedHostSlice<u8>) {
        self.device().half_staging.insert(key, pinned);
    }

    /// Copies `host` into `out` and waits for the copy.
    fn upload_half<H: HalfValue>(
        &self,
        host: &[H],
        out: &mut CudaViewMut<'_, H>,
    ) -> Result<(), KvError> {
        guarded("copy to device", || self.stream.memcpy_htod(host, out))
            .and_then(|()| guarded("synchronize", || self.stream.synchronize()))
            .map_err(gpu_err)
    }
}

/// The pinned bytes as `H`s (page-locked memory is page-aligned).
fn halves<H: HalfValue>(pinned: &mut PinnedHostSlice<u8>) -> Result<&mut [H], KvError> {
    let bytes = guarded("pinned memory", || pinned.as_mut_slice()).map_err(gpu_err)?;
    bytemuck::try_cast_slice_mut(bytes)
        .map_err(|e| KvError::Invalid(format!("pinned staging buffer as {}: {e}", H::DTYPE)))
}
