//! librdmacm's connection manager as psnet uses it: the event codes it acts on and their
//! names, the event channel ([`CmChannel`]), ids ([`CmId`]) and events ([`CmEvent`]). The FFI
//! itself is `sys::rdmacm`'s, and so are the event codes and their names: they are
//! librdmacm's `enum rdma_cm_event_type`, which that wrapper reads events with.

pub use crate::sys::rdmacm::{event_name, kind, watch, CmChannel, CmEvent, CmId, ConnParam};
