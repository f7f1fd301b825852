//! Pushes from device memory: any [`DeviceBytes`] (a GPU buffer through `GpuKv`, or the
//! simulated device in tests). Each part of the key goes as a device segment, which the
//! transport copies out in chunks while it writes the one before, or its NIC reads in place;
//! the servers see the same bytes a host push of the same values sends. With gradient
//! compression on, the values are copied to the host and pushed as a host push is (`GpuKv`
//! quantizes on the GPU instead).

use psnet_transport::device::{copy_all, DeviceSlice};
use psnet_transport::{DeviceBytes, Segment, Transport};

use super::{fill, Worker};
use crate::error::KvError;
use crate::proto::worker::PreparedPart;
use crate::value::{self, Value};

impl<T: Transport> Worker<T> {
    /// Pushes `key`'s values from device memory: `values` holds them as little-endian `V`s
    /// (see [`Worker::push`]).
    pub async fn push_device<V: Value>(
        &self,
        key: u64,
        values: &dyn DeviceBytes,
    ) -> Result<(), KvError> {
        let n = elems::<V>(key, values)?;
        let Some(parts) = self.device_parts::<V>(key, n, false)? else {
            let host = self.copied::<V>(key, values).await?;
            return self.push(key, &host).await;
        };
        let slices = slices(&parts, values, std::mem::size_of::<V>())?;
        let waits = self
            .send_push_parts(&parts, |k, _| Segment::device(&slices[k]))
            .await?;
        for wait in waits {
            self.shared.settle(wait).await?;
        }
        Ok(())
    }

    /// Pushes `key`'s values from device memory and pulls the updated value into `out`, in
    /// one exchange per server (see [`Worker::pushpull`]).
    pub async fn pushpull_device<V: Value>(
        &self,
        key: u64,
        values: &dyn DeviceBytes,
        out: &mut [V],
    ) -> Result<(), KvError> {
        let n = elems::<V>(key, values)?;
        if n != out.len() {
            return Err(KvError::SizeMismatch {
                key,
                expected: n,
                got: out.len(),
            });
        }
        let Some(parts) = self.device_parts::<V>(key, n, true)? else {
            let host = self.copied::<V>(key, values).await?;
            return self.pushpull(key, &host, out).await;
        };
        let slices = slices(&parts, values, std::mem::size_of::<V>())?;
        let waits = self
            .send_push_parts(&parts, |k, _| Segment::device(&slices[k]))
            .await?;
        for ((_, pp), wait) in parts.iter().zip(waits) {
            let answer = self.shared.settle(wait).await?;
            let p = pp.part;
            let from = self.shared.servers[p.server];
            fill(key, &mut out[p.offset..p.offset + p.len], answer, from)?;
        }
        Ok(())
    }

    /// The parts of a push from device memory; None with gradient compression on.
    fn device_parts<V: Value>(
        &self,
        key: u64,
        n: usize,
        pull_back: bool,
    ) -> Result<Option<Vec<(usize, PreparedPart)>>, KvError> {
        let parts = self
            .shared
            .state()
            .prepare_device_push(key, n, V::DTYPE, pull_back)?;
        Ok(parts.map(|parts| parts.into_iter().map(|p| (0, p)).collect()))
    }

    /// The values copied to the host.
    async fn copied<V: Value>(
        &self,
        key: u64,
        values: &dyn DeviceBytes,
    ) -> Result<Vec<V>, KvError> {
        let bytes = copy_all(values).await.map_err(|e| {
            KvError::Invalid(format!(
                "key {key}: reading the values from device memory: {e}"
            ))
        })?;
        let mut host = vec![V::zeroed(); bytes.len() / std::mem::size_of::<V>()];
        value::copy_from_le(&mut host, &bytes);
        Ok(host)
    }
}

/// How many `V`s `values` holds; an error if its length is not a whole number of them.
fn elems<V: Value>(key: u64, values: &dyn DeviceBytes) -> Result<usize, KvError> {
    let size = std::mem::size_of::<V>();
    if values.len() % size != 0 {
        return Err(KvError::Invalid(format!(
            "key {key}: {} bytes of device memory are not a whole number of {}-byte {} values",
            values.len(),
            size,
            V::DTYPE
        )));
    }
    Ok(values.len() / size)
}

/// Each part's bytes of `values`.
fn slices<'a>(
    parts: &[(usize, PreparedPart)],
    values: &'a dyn DeviceBytes,
    size: usize,
) -> Result<Vec<DeviceSlice<'a>>, KvError> {
    parts
        .iter()
        .map(|(_, pp)| {
            let p = pp.part;
            DeviceSlice::new(values, p.offset * size..(p.offset + p.len) * size).ok_or_else(|| {
                KvError::Invalid(format!("key {}: a part leaves the device buffer", pp.key))
            })
        })
        .collect()
}
