//! A lock-free, allocation-free table of the client's BO mappings (made through `mmap` on the
//! device fd), so that `munmap` — which the allocator calls too — can tell without locking whether
//! it concerns a BO. Only a hit takes the device lock.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};

const SLOTS: usize = 4096;
const FREE: u8 = 0;
const BUSY: u8 = 1;
const LIVE: u8 = 2;

struct Slot {
    state: AtomicU8,
    start: AtomicU64,
    len: AtomicU64,
    /// The BO mapping's base VA (what the device state knows it by).
    base: AtomicU64,
}

static TABLE: [Slot; SLOTS] = [const {
    Slot {
        state: AtomicU8::new(FREE),
        start: AtomicU64::new(0),
        len: AtomicU64::new(0),
        base: AtomicU64::new(0),
    }
}; SLOTS];

static COUNT: AtomicUsize = AtomicUsize::new(0);

/// Number of tracked mappings (0 = `munmap` has nothing to look at).
pub fn live() -> usize {
    COUNT.load(Ordering::Acquire)
}

/// Tracks `[start, start+len)`, a mapping of the BO whose base VA is `base`. Returns false when
/// the table is full (the mapping is then simply not tracked).
pub fn register(start: u64, len: u64, base: u64) -> bool {
    for s in TABLE.iter() {
        if s.state
            .compare_exchange(FREE, BUSY, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            s.start.store(start, Ordering::Relaxed);
            s.len.store(len, Ordering::Relaxed);
            s.base.store(base, Ordering::Relaxed);
            s.state.store(LIVE, Ordering::Release);
            COUNT.fetch_add(1, Ordering::AcqRel);
            return true;
        }
    }
    false
}

/// Removes every tracked mapping overlapping `[addr, addr+len)` and calls `f` with its base.
pub fn take_overlapping(addr: u64, len: u64, mut f: impl FnMut(u64)) {
    let end = addr.saturating_add(len.max(1));
    for s in TABLE.iter() {
        if s.state.load(Ordering::Acquire) != LIVE {
            continue;
        }
        let (st, l) = (
            s.start.load(Ordering::Relaxed),
            s.len.load(Ordering::Relaxed),
        );
        if st < end
            && addr < st.saturating_add(l)
            && s.state
                .compare_exchange(LIVE, BUSY, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            let base = s.base.load(Ordering::Relaxed);
            s.state.store(FREE, Ordering::Release);
            COUNT.fetch_sub(1, Ordering::AcqRel);
            f(base);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_and_take() {
        assert!(register(0x10000, 0x2000, 0x10000));
        assert!(register(0x40000, 0x1000, 0x3f000));
        let mut got = Vec::new();
        take_overlapping(0x11000, 0x100, |b| got.push(b));
        assert_eq!(got, [0x10000]);
        take_overlapping(0x10000, 0x2000, |b| got.push(b));
        assert_eq!(got, [0x10000], "already taken");
        take_overlapping(0x3f000, 0x2000, |b| got.push(b));
        assert_eq!(got, [0x10000, 0x3f000]);
    }
}
