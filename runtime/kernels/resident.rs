//! Which kernels hold a hardware context right now: LRU bookkeeping for a device with a limited
//! number of contexts (`QUERY_RESOURCE_INFO.npu_task_max`).
//!
//! This module only decides; the device backend creates and destroys the contexts it is told to.
//! A decode step touches the same ~5 kernels every token, so with enough slots everything stays
//! resident; with too few, the least recently used unpinned kernel is evicted.

use std::collections::HashMap;
use std::hash::Hash;

/// What the caller must do to make a kernel resident.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Residency<K> {
    /// Already resident: nothing to do.
    Hit,
    /// Not resident: create its context, after destroying `evict`'s if given.
    Load { evict: Option<K> },
}

/// All slots are taken by pinned kernels.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("all {capacity} resident kernel slots are pinned")]
pub struct AllPinned {
    pub capacity: usize,
}

/// LRU set of resident kernels with pinning.
#[derive(Debug)]
pub struct ResidentSet<K> {
    capacity: usize,
    clock: u64,
    /// key → (last use, pinned)
    entries: HashMap<K, (u64, bool)>,
}

impl<K: Clone + Eq + Hash> ResidentSet<K> {
    /// A set with room for `capacity` resident kernels (at least 1).
    pub fn new(capacity: usize) -> Self {
        ResidentSet {
            capacity: capacity.max(1),
            clock: 0,
            entries: HashMap::new(),
        }
    }

    /// Slots.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Resident kernels.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Is nothing resident?
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Is `key` resident?
    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Use `key` now: a hit refreshes it; a miss admits it, evicting the least recently used
    /// unpinned kernel when full.
    pub fn acquire(&mut self, key: &K) -> Result<Residency<K>, AllPinned> {
        self.clock += 1;
        if let Some(entry) = self.entries.get_mut(key) {
            entry.0 = self.clock;
            return Ok(Residency::Hit);
        }
        let mut evict = None;
        if self.entries.len() >= self.capacity {
            let victim = self
                .entries
                .iter()
                .filter(|(_, &(_, pinned))| !pinned)
                .min_by_key(|(_, &(used, _))| used)
                .map(|(k, _)| k.clone())
                .ok_or(AllPinned {
                    capacity: self.capacity,
                })?;
            self.entries.remove(&victim);
            evict = Some(victim);
        }
        self.entries.insert(key.clone(), (self.clock, false));
        Ok(Residency::Load { evict })
    }

    /// Pin or unpin a resident kernel (a pinned kernel is never evicted). Returns false if absent.
    pub fn set_pinned(&mut self, key: &K, pinned: bool) -> bool {
        match self.entries.get_mut(key) {
            Some(entry) => {
                entry.1 = pinned;
                true
            }
            None => false,
        }
    }

    /// Forget `key` (its context was destroyed elsewhere). Returns whether it was resident.
    pub fn remove(&mut self, key: &K) -> bool {
        self.entries.remove(key).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_used_unpinned_kernel_is_evicted() {
        let mut set = ResidentSet::new(2);
        assert_eq!(set.acquire(&"a"), Ok(Residency::Load { evict: None }));
        assert_eq!(set.acquire(&"b"), Ok(Residency::Load { evict: None }));
        assert_eq!(set.acquire(&"a"), Ok(Residency::Hit));
        assert_eq!(set.acquire(&"c"), Ok(Residency::Load { evict: Some("b") }));
        assert!(set.set_pinned(&"a", true));
        assert_eq!(set.acquire(&"d"), Ok(Residency::Load { evict: Some("c") }));
        assert!(set.set_pinned(&"d", true));
        assert_eq!(set.acquire(&"e"), Err(AllPinned { capacity: 2 }));
        assert!(set.remove(&"d"));
        assert_eq!(set.acquire(&"e"), Ok(Residency::Load { evict: None }));
        assert_eq!(set.len(), 2);
        assert!(set.contains(&"a") && set.contains(&"e"));
    }
}
