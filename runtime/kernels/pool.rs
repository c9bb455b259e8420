//! A persistent worker pool: resident threads, a spin-then-park wake-up, and the caller as worker 0.
//!
//! Modelled on ggml's `ggml_barrier` / candle's `BarrierPool`: an operation is one generation bump;
//! workers spin for a short while on the generation counter (so back-to-back GEMMs of a decode step
//! cost no syscalls) and then park on a condition variable (so an idle process burns no CPU). Work
//! inside an operation is claimed by the job itself (see [`ChunkCounter`], [`ShareCounter`]), in
//! contiguous chunks, so
//! each core streams a contiguous stretch of weights for the hardware prefetcher.
//!
//! Jobs must claim work dynamically: a worker that has not *entered* an operation by the time the
//! caller has finished it is shut out (the entry gate closes), so on an oversubscribed machine a
//! descheduled worker costs nothing instead of a scheduler time slice per operation. A job is
//! therefore called by *at most* every pool thread, and by the caller always.
//!
//! One global pool ([`Pool::global`]) sized to the available cores, or `XDNA_THREADS`.

// Unsafe is this module's job: the shared-buffer handle and the lifetime-erased job of the workers.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex};

/// How many times a waiting thread polls before it parks / yields. About 10-50 µs: long enough to
/// cover the gap between two GEMMs of a decode step, short enough not to starve other processes.
const SPIN_LIMIT: u32 = 20_000;
/// Gate bit: workers may still enter the current operation.
const GATE_OPEN: u64 = 1 << 31;
/// Gate bits counting the workers inside the current operation.
const GATE_INSIDE: u64 = GATE_OPEN - 1;

/// A job: called once per participating thread with (thread index, thread count).
type Job<'a> = dyn Fn(usize, usize) + Sync + 'a;

struct Shared {
    /// Bumped once per operation; workers run the job when they see a new value.
    generation: AtomicUsize,
    /// Entry gate of the current operation: `generation << 32 | OPEN | workers inside`.
    gate: AtomicU64,
    /// Workers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    /// The current job, type-erased to `'static` (see the SAFETY note in `Pool::run`).
    job: Mutex<Option<&'static Job<'static>>>,
    /// Threads taking part in the current job (≤ pool size).
    active_threads: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    /// Set when a worker's job panicked; the caller re-raises.
    panicked: AtomicBool,
    shutdown: AtomicBool,
}

/// A fixed set of resident worker threads; the calling thread takes part as thread 0.
pub struct Pool {
    shared: Arc<Shared>,
    threads: usize,
    /// Serializes operations: one job runs at a time (a nested or concurrent call runs inline).
    busy: Mutex<()>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl Pool {
    /// A pool with `threads` participants (`threads - 1` resident workers plus the caller).
    pub fn new(threads: usize) -> Pool {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            gate: AtomicU64::new(0),
            sleepers: AtomicUsize::new(0),
            job: Mutex::new(None),
            active_threads: AtomicUsize::new(threads),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
        });
        let mut handles = Vec::with_capacity(threads - 1);
        for index in 1..threads {
            let shared = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("xdna-worker-{index}"))
                .spawn(move || worker_loop(&shared, index));
            match spawned {
                Ok(handle) => handles.push(handle),
                // Could not spawn (resource limits): run with the threads we have.
                Err(_) => break,
            }
        }
        let threads = handles.len() + 1;
        shared.active_threads.store(threads, Ordering::Relaxed);
        Pool {
            shared,
            threads,
            busy: Mutex::new(()),
            handles,
        }
    }

    /// The process-wide pool: `XDNA_THREADS` if set and valid, else the available cores.
    pub fn global() -> &'static Pool {
        static GLOBAL: OnceLock<Pool> = OnceLock::new();
        GLOBAL.get_or_init(|| Pool::new(default_threads()))
    }

    /// Threads taking part in each operation (including the caller).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run `job(thread_index, thread_count)` on every pool thread, the caller included, and return
    /// when all have finished. A call made while another operation runs (nested from inside a job,
    /// or from a second thread) runs inline on the caller as a single thread.
    pub fn run(&self, job: &(dyn Fn(usize, usize) + Sync)) {
        if self.threads == 1 {
            job(0, 1);
            return;
        }
        let Some(_busy) = self.busy.try_lock() else {
            job(0, 1);
            return;
        };
        // SAFETY: the `'static` lifetime is a lie told only to store the reference in `Shared`.
        // It is sound because this function does not return (nor unwind past the wait below)
        // before the entry gate is closed and no worker is inside, i.e. every worker that got the
        // reference has finished calling the job, and the slot is cleared before returning.
        let erased: &'static Job<'static> =
            unsafe { std::mem::transmute::<&Job<'_>, &'static Job<'static>>(job) };
        *self.shared.job.lock() = Some(erased);
        let generation = self
            .shared
            .generation
            .load(Ordering::SeqCst)
            .wrapping_add(1);
        let tag = (generation as u64 & 0xFFFF_FFFF) << 32;
        self.shared.gate.store(tag | GATE_OPEN, Ordering::SeqCst);
        self.shared.generation.store(generation, Ordering::SeqCst);
        if self.shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = self.shared.sleep_lock.lock();
            self.shared.wake.notify_all();
        }
        let caller =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(0, self.threads)));
        // Close the gate: a worker that has not entered yet will skip this operation.
        self.shared.gate.fetch_and(!GATE_OPEN, Ordering::SeqCst);
        let mut spins = 0u32;
        while self.shared.gate.load(Ordering::Acquire) & GATE_INSIDE != 0 {
            if spins < SPIN_LIMIT {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        *self.shared.job.lock() = None;
        let worker_panicked = self.shared.panicked.swap(false, Ordering::SeqCst);
        if let Err(payload) = caller {
            std::panic::resume_unwind(payload);
        }
        if worker_panicked {
            panic!("a worker thread panicked while running a pool job");
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        {
            let _guard = self.shared.sleep_lock.lock();
            self.shared.wake.notify_all();
        }
        for handle in self.handles.drain(..) {
            let _ = handle.join();
        }
    }
}

fn default_threads() -> usize {
    if let Some(n) = std::env::var("XDNA_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        return n;
    }
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn worker_loop(shared: &Shared, index: usize) {
    let mut seen = 0usize;
    loop {
        // Spin, then park, until the generation moves.
        let mut spins = 0u32;
        let mut generation = shared.generation.load(Ordering::Acquire);
        while generation == seen {
            if spins < SPIN_LIMIT {
                spins += 1;
                std::hint::spin_loop();
            } else {
                let mut guard = shared.sleep_lock.lock();
                shared.sleepers.fetch_add(1, Ordering::SeqCst);
                // Re-check after announcing ourselves: the caller bumps the generation and then
                // reads `sleepers` (both SeqCst), so either we see the bump or it sees us and
                // notifies under the lock we hold until `wait` releases it.
                if shared.generation.load(Ordering::SeqCst) == seen {
                    shared.wake.wait(&mut guard);
                }
                shared.sleepers.fetch_sub(1, Ordering::SeqCst);
                spins = 0;
            }
            generation = shared.generation.load(Ordering::Acquire);
        }
        seen = generation;
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        // Enter the operation if its gate is still open for this generation.
        let tag = (generation as u64 & 0xFFFF_FFFF) << 32;
        let entered = shared
            .gate
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |gate| {
                (gate & !(GATE_OPEN | GATE_INSIDE) == tag && gate & GATE_OPEN != 0)
                    .then_some(gate + 1)
            })
            .is_ok();
        if !entered {
            continue;
        }
        let job = *shared.job.lock();
        if let Some(job) = job {
            let threads = shared.active_threads.load(Ordering::Relaxed);
            let result =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(index, threads)));
            if result.is_err() {
                shared.panicked.store(true, Ordering::SeqCst);
            }
        }
        shared.gate.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Hands out contiguous chunks of `0..total` to whichever thread asks next (ggml's
/// `current_chunk`): fast threads take more chunks, and each chunk is one sequential stream.
///
/// Two schedules: fixed-size chunks ([`ChunkCounter::new`]), or guided ones
/// ([`ChunkCounter::guided`]) that shrink as the work runs out — long streams first, then single
/// items at the end, so both threads reach the per-call barrier together (with fixed chunks of a
/// small GEMM the last chunk alone was an eighth of the call, and the other thread waited for it).
pub struct ChunkCounter {
    next: AtomicUsize,
    total: usize,
    /// Fixed schedule: the chunk size. Guided: the smallest chunk.
    chunk: usize,
    /// Guided schedule: a claim takes `remaining / divisor` (at least `chunk`); 0 = fixed.
    divisor: usize,
}

impl ChunkCounter {
    /// Split `0..total` into about `chunks_per_thread × threads` chunks (at least one item each).
    pub fn new(total: usize, threads: usize, chunks_per_thread: usize) -> ChunkCounter {
        let pieces = (threads * chunks_per_thread).max(1);
        ChunkCounter {
            next: AtomicUsize::new(0),
            total,
            chunk: total.div_ceil(pieces).max(1),
            divisor: 0,
        }
    }

    /// Guided schedule: each claim takes `1 / (2 × threads)` of what is left, never fewer than
    /// `min_chunk` items (nor more than are left).
    pub fn guided(total: usize, threads: usize, min_chunk: usize) -> ChunkCounter {
        ChunkCounter {
            next: AtomicUsize::new(0),
            total,
            chunk: min_chunk.max(1),
            divisor: 2 * threads.max(1),
        }
    }

    /// The next unclaimed range, or `None` when all are taken.
    pub fn claim(&self) -> Option<std::ops::Range<usize>> {
        if self.divisor == 0 {
            let start = self.next.fetch_add(self.chunk, Ordering::Relaxed);
            return (start < self.total).then(|| start..(start + self.chunk).min(self.total));
        }
        let mut start = self.next.load(Ordering::Relaxed);
        loop {
            if start >= self.total {
                return None;
            }
            let left = self.total - start;
            let size = (left / self.divisor).max(self.chunk).min(left);
            match self.next.compare_exchange_weak(
                start,
                start + size,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(start..start + size),
                Err(now) => start = now,
            }
        }
    }
}

/// Hands out `0..total` as one contiguous share per thread, each claimed `chunk` items at a time
/// from the thread's own counter, on its own cache line: claims cost no cache-line transfer between
/// cores while a thread works through its share, and each share is one sequential stream. A thread
/// whose share is done claims from the others' (so the share of a worker that never entered the
/// operation, or was descheduled, is still done), and only then do two threads touch one counter.
///
/// Against [`ChunkCounter::guided`] with single items, on the multi-row GEMMs of a 16-row decode
/// pass: the guided schedule's claims alternate between the two threads at the end of every call,
/// one contended atomic and one broken weight stream per block.
pub struct ShareCounter {
    shares: Vec<Share>,
    chunk: usize,
}

/// One thread's share: the next unclaimed item and the end, alone on a cache-line pair (the
/// adjacent-line prefetcher fetches lines in pairs).
#[repr(align(128))]
struct Share {
    next: AtomicUsize,
    end: usize,
}

impl ShareCounter {
    /// `0..total` in `threads` contiguous shares whose sizes differ by at most one item, each
    /// claimed `chunk` items (at least 1) at a time.
    pub fn new(total: usize, threads: usize, chunk: usize) -> ShareCounter {
        let threads = threads.max(1);
        let shares = (0..threads)
            .map(|t| Share {
                next: AtomicUsize::new(t * total / threads),
                end: (t + 1) * total / threads,
            })
            .collect();
        ShareCounter {
            shares,
            chunk: chunk.max(1),
        }
    }

    /// The next unclaimed range for thread `thread` (the pool's thread index): from its own share
    /// first, then from the others' in turn; `None` when everything is taken.
    pub fn claim(&self, thread: usize) -> Option<std::ops::Range<usize>> {
        let n = self.shares.len();
        for offset in 0..n {
            let share = &self.shares[(thread + offset) % n];
            // A plain load first: a finished share is not written again.
            if share.next.load(Ordering::Relaxed) >= share.end {
                continue;
            }
            let start = share.next.fetch_add(self.chunk, Ordering::Relaxed);
            if start < share.end {
                return Some(start..(start + self.chunk).min(share.end));
            }
        }
        None
    }
}

/// A buffer that the threads of one pool job write in disjoint parts (a GEMM's output columns of
/// every row, an attention's heads or columns, a quantizer's rows): the one place where a mutable
/// buffer is shared with the pool, as a pointer and a length.
///
/// [`SharedMut::new`] borrows the buffer mutably for `'a`, so nothing else touches it while the
/// handle lives. Every access through the handle is `unsafe`, with one contract: the elements a
/// thread reads or writes through it are claimed by that thread alone (from a [`ChunkCounter`] or
/// [`ShareCounter`], or a partition fixed before the job), so no two threads touch one element
/// at the same time; the pool job ends before the handle does.
pub struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _buffer: std::marker::PhantomData<&'a mut [T]>,
}

impl<T> Clone for SharedMut<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedMut<'_, T> {}

// SAFETY: the handle is a `&'a mut [T]` split between threads; the contract of its accessors keeps
// the threads' elements disjoint, so sending it or sharing it is sending `&mut` to disjoint parts,
// which needs `T: Send` (and `T: Sync` for the read-only views).
unsafe impl<T: Send + Sync> Send for SharedMut<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    /// Share `buffer` with the pool threads for `'a`.
    pub fn new(buffer: &'a mut [T]) -> Self {
        SharedMut {
            ptr: buffer.as_mut_ptr(),
            len: buffer.len(),
            _buffer: std::marker::PhantomData,
        }
    }

    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Is the buffer empty?
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer's first element, for kernels that write strided parts through raw pointers
    /// (those writes are under the type's contract).
    pub fn as_mut_ptr(&self) -> *mut T {
        self.ptr
    }

    /// Elements `range`, to write.
    ///
    /// # Safety
    /// The type's contract: no other thread reads or writes any of `range` while the slice lives.
    pub unsafe fn slice_mut(&self, range: std::ops::Range<usize>) -> &'a mut [T] {
        assert!(range.start <= range.end && range.end <= self.len);
        // SAFETY: inside the buffer (asserted), which is borrowed for 'a; exclusive by the
        // caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }

    /// Elements `range`, to read.
    ///
    /// # Safety
    /// The type's contract: no thread writes any of `range` while the slice lives.
    pub unsafe fn slice(&self, range: std::ops::Range<usize>) -> &'a [T] {
        assert!(range.start <= range.end && range.end <= self.len);
        // SAFETY: inside the buffer (asserted), which is borrowed for 'a; not written meanwhile by
        // the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr.add(range.start), range.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_is_processed_exactly_once() {
        let pool = Pool::new(3);
        for round in 0..200 {
            let total = 1 + round * 7;
            let counter = ChunkCounter::new(total, pool.threads(), 4);
            assert_each_item_claimed_once(&pool, &counter, total);
        }
    }

    /// Run `counter` dry on every thread of `pool`: each of `0..total` is handed out exactly once.
    fn assert_each_item_claimed_once(pool: &Pool, counter: &ChunkCounter, total: usize) {
        let counts: Vec<AtomicUsize> = (0..total).map(|_| AtomicUsize::new(0)).collect();
        pool.run(&|_, _| {
            while let Some(range) = counter.claim() {
                for i in range {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        assert!(
            counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
            "total {total}"
        );
    }

    #[test]
    fn guided_chunks_cover_every_item_once_and_shrink_to_the_minimum() {
        let pool = Pool::new(3);
        for total in [0usize, 1, 2, 17, 30, 96, 1536, 10_007] {
            let counter = ChunkCounter::guided(total, pool.threads(), 2);
            assert_each_item_claimed_once(&pool, &counter, total);
        }
        // Single-threaded claims: 1/6 of the rest each time, at least 2, the last one what is left.
        let counter = ChunkCounter::guided(100, 3, 2);
        let sizes: Vec<usize> = std::iter::from_fn(|| counter.claim().map(|r| r.len())).collect();
        assert_eq!(sizes[..4], [16, 14, 11, 9]);
        assert_eq!(sizes.iter().sum::<usize>(), 100);
        assert!(sizes.windows(2).all(|w| w[1] <= w[0]));
        assert!(sizes[..sizes.len() - 1].iter().all(|&s| s >= 2));
    }

    #[test]
    fn shares_cover_every_item_once_whoever_claims_them() {
        let pool = Pool::new(3);
        for total in [0usize, 1, 2, 3, 17, 18, 30, 96, 1537] {
            for chunk in [1usize, 2, 5] {
                let counter = ShareCounter::new(total, pool.threads(), chunk);
                let counts: Vec<AtomicUsize> = (0..total).map(|_| AtomicUsize::new(0)).collect();
                pool.run(&|index, _| {
                    while let Some(range) = counter.claim(index) {
                        assert!(range.len() <= chunk && !range.is_empty());
                        for i in range {
                            counts[i].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
                assert!(
                    counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                    "total {total}, chunk {chunk}"
                );
            }
        }
        // One thread alone (the others never entered): its own share in order, then the others'.
        let counter = ShareCounter::new(10, 3, 2);
        let ranges: Vec<_> = std::iter::from_fn(|| counter.claim(1)).collect();
        assert_eq!(ranges, [3..5, 5..6, 6..8, 8..10, 0..2, 2..3]);
    }

    #[test]
    fn shared_buffer_parts_claimed_by_one_thread_each_are_all_written() {
        let pool = Pool::new(3);
        let mut buffer = vec![0usize; 1000];
        let shared = SharedMut::new(&mut buffer);
        let counter = ChunkCounter::new(100, pool.threads(), 4);
        pool.run(&|_, _| {
            while let Some(range) = counter.claim() {
                for part in range {
                    // SAFETY: part `part` (ten elements) is claimed by this thread alone.
                    let own = unsafe { shared.slice_mut(10 * part..10 * part + 10) };
                    for (i, v) in own.iter_mut().enumerate() {
                        *v = 10 * part + i;
                    }
                }
            }
        });
        assert!(buffer.iter().enumerate().all(|(i, &v)| v == i));
    }

    #[test]
    fn workers_wake_after_parking_and_nested_calls_run_inline() {
        let pool = Pool::new(2);
        std::thread::sleep(std::time::Duration::from_millis(50));
        let hits = AtomicUsize::new(0);
        pool.run(&|_, _| {
            hits.fetch_add(1, Ordering::Relaxed);
            pool.run(&|index, threads| {
                assert_eq!((index, threads), (0, 1));
            });
        });
        // The caller always runs the job; a worker only if it entered before the caller finished.
        let hits = hits.load(Ordering::Relaxed);
        assert!((1..=pool.threads()).contains(&hits));
    }

    #[test]
    fn a_worker_panic_reaches_the_caller() {
        let pool = Pool::new(2);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|index, _| {
                if index == 1 {
                    panic!("boom");
                }
            })
        }));
        // The worker may have been shut out; if it ran, its panic reached the caller.
        let _ = result;
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|_, _| panic!("boom"))
        }));
        assert!(result.is_err());
        // The pool still works afterwards.
        let counter = ChunkCounter::new(1000, 2, 4);
        let done = AtomicUsize::new(0);
        pool.run(&|_, _| {
            while let Some(r) = counter.claim() {
                done.fetch_add(r.len(), Ordering::Relaxed);
            }
        });
        assert_eq!(done.load(Ordering::Relaxed), 1000);
    }
}
