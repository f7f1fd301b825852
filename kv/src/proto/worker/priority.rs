//! The priority of a worker's requests: a key's declaration order, as BytePS gives it. The
//! key a job declares (initializes) first is its first layer's, which the next forward pass
//! needs first, so it is sent, and answered, before keys declared after it whose requests
//! are still waiting. MXNet's Gluon trainer gives the same order (`priority=-index`).

use std::collections::HashMap;

use super::layout::key_of_slot;

/// Priorities of the keys a worker declared: 0 for the first, -1 for the next, and so on;
/// keys never declared come last.
#[derive(Debug, Default)]
pub struct Priorities {
    declared: HashMap<u64, i32>,
    /// `PSNET_KV_PRIORITY=0`: every request has the same priority (sent and answered in the
    /// order they came).
    off: bool,
}

/// What a key this worker never declared gets: after every declared key.
pub const UNDECLARED: i32 = i32::MIN;

impl Priorities {
    /// Priorities by declaration order (`on`), or none.
    pub fn new(on: bool) -> Self {
        Priorities {
            declared: HashMap::new(),
            off: !on,
        }
    }

    /// Notes that `key` was declared; a key declared again keeps its first place.
    pub fn declare(&mut self, key: u64) {
        let next = -i32::try_from(self.declared.len()).unwrap_or(i32::MAX);
        self.declared.entry(key).or_insert(next.max(UNDECLARED + 1));
    }

    /// The priority of a request for `slot` (a key, or a piece of one).
    pub fn of_slot(&self, slot: u64) -> i32 {
        if self.off {
            return 0;
        }
        self.declared
            .get(&slot)
            .or_else(|| self.declared.get(&key_of_slot(slot)))
            .copied()
            .unwrap_or(UNDECLARED)
    }
}

#[cfg(test)]
mod tests {
    use super::super::layout::piece_key;
    use super::*;

    #[test]
    fn declared_first_goes_first_and_pieces_share_their_keys_priority() {
        let mut p = Priorities::new(true);
        for key in [7, 3, 9, 3] {
            p.declare(key);
        }
        assert_eq!(p.of_slot(7), 0);
        assert_eq!(p.of_slot(3), -1);
        assert_eq!(p.of_slot(9), -2);
        assert_eq!(p.of_slot(piece_key(3, 5)), -1);
        assert_eq!(p.of_slot(42), UNDECLARED);
        let mut off = Priorities::new(false);
        off.declare(7);
        off.declare(3);
        assert_eq!((off.of_slot(7), off.of_slot(3), off.of_slot(42)), (0, 0, 0));
    }
}
