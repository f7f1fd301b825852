use std::any::Any;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// Transport-specific identity of a memory registration (an RDMA lkey/rkey pair; 0 on TCP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RegionKey(pub u64);

/// A buffer the transport can send from (and receive into) without further registration.
///
/// On TCP this is ordinary memory. On RDMA the memory is registered with the NIC for as long
/// as the buffer lives: the registration handle is kept in `registration` and released when the
/// buffer is dropped, so a registration can never outlive its memory. Because sends borrow
/// segments until they complete, a buffer cannot be freed or reused while a send uses it.
pub struct RegisteredBuf {
    data: Box<[u8]>,
    key: RegionKey,
    // Field order matters: the registration is dropped before the memory it covers.
    registration: Option<Arc<dyn Any + Send + Sync>>,
}

impl RegisteredBuf {
    /// A zeroed buffer with no registration (what TCP hands out).
    pub fn unregistered(len: usize) -> Self {
        RegisteredBuf {
            data: vec![0u8; len].into_boxed_slice(),
            key: RegionKey::default(),
            registration: None,
        }
    }

    /// Wraps memory that a transport has registered; `registration` is dropped with the buffer
    /// (and before the memory is freed).
    pub fn with_registration(
        data: Box<[u8]>,
        key: RegionKey,
        registration: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        RegisteredBuf {
            data,
            key,
            registration: Some(registration),
        }
    }

    /// The registration key (0 when unregistered).
    pub fn key(&self) -> RegionKey {
        self.key
    }

    /// Whether a transport registration backs this buffer.
    pub fn is_registered(&self) -> bool {
        self.registration.is_some()
    }
}

impl Drop for RegisteredBuf {
    fn drop(&mut self) {
        // Deregister before the memory goes away.
        self.registration.take();
    }
}

impl Deref for RegisteredBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.data
    }
}

impl DerefMut for RegisteredBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.data
    }
}

impl fmt::Debug for RegisteredBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredBuf")
            .field("len", &self.data.len())
            .field("key", &self.key)
            .field("registered", &self.is_registered())
            .finish()
    }
}
