//! Persistent worker threads for the CPU kernels, and the per-thread scratch of a parallel call
//! ([`in_parallel`]).
//!
//! A CPU call spreads its work over the cores. Spawning threads for each call cost tens of
//! microseconds a thread (a stack mapped and unmapped, a clone), which is a tenth of a call on
//! small shapes; these threads are started once, on first use, and then wait on a condition
//! variable between calls.
//!
//! [`run`] is a scoped fork-join: the caller runs part 0 itself and returns only when every part
//! is done, so the parts may borrow from its stack. Parts that no worker has picked up by the time
//! the caller is done with its own are taken back and run by the caller: a call never waits on
//! workers that are busy with another call (XLA may run custom calls from several threads). A
//! panic in any part is re-raised in the caller after all parts have finished.

use std::any::Any;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// One part of a call: `part` of the call behind `call`.
struct Task {
    call: Arc<Call>,
    part: usize,
}

/// What the parts of one call share.
struct Call {
    /// The caller's function, its lifetime erased: it is called only while the caller waits in
    /// [`run`], which does not return before every part is finished (`state.0` is 0).
    f: *const (dyn Fn(usize) + Sync),
    /// Parts not finished, and the first panic of one.
    state: Mutex<(usize, Option<Box<dyn Any + Send>>)>,
    done: Condvar,
}

// SAFETY: `f` points to a `Sync` function that outlives every use of it (see `Call::f`).
unsafe impl Send for Call {}
unsafe impl Sync for Call {}

impl Call {
    fn run_part(&self, part: usize) {
        // SAFETY: see `Call::f`; this part is not finished yet, so the caller is still waiting.
        let f = unsafe { &*self.f };
        let result = catch_unwind(AssertUnwindSafe(|| f(part)));
        let mut state = lock(&self.state);
        if let Err(payload) = result {
            state.1.get_or_insert(payload);
        }
        state.0 -= 1;
        if state.0 == 0 {
            self.done.notify_all();
        }
    }
}

struct Pool {
    queue: Mutex<VecDeque<Task>>,
    ready: Condvar,
    /// Tasks in `queue`, read without the lock by polling workers.
    queued: AtomicUsize,
    /// Workers started so far.
    workers: Mutex<usize>,
}

/// How long an idle worker polls for work before it sleeps.
const POLL: Duration = Duration::from_millis(2);

/// A poisoned lock only means a part panicked while holding it; the data stays consistent.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        queue: Mutex::new(VecDeque::new()),
        ready: Condvar::new(),
        queued: AtomicUsize::new(0),
        workers: Mutex::new(0),
    })
}

impl Pool {
    /// Starts workers until there are `n` (or as many as the system lets us start).
    fn ensure_workers(&'static self, n: usize) {
        let mut workers = lock(&self.workers);
        while *workers < n {
            let name = format!("xla-ssm-cpu-{}", *workers);
            if std::thread::Builder::new().name(name).spawn(move || self.work()).is_err() {
                break; // fewer workers: the caller takes their parts back
            }
            *workers += 1;
        }
    }

    fn work(&self) {
        loop {
            // Poll for a while before sleeping (yielding the core to anything else runnable), so
            // that back-to-back calls, as in a jitted training loop, find the worker awake instead
            // of paying a wake-up. Not measured on its own: it costs up to POLL of CPU per call.
            let start = Instant::now();
            while self.queued.load(Ordering::Acquire) == 0 && start.elapsed() < POLL {
                std::thread::yield_now();
            }
            let task = {
                let mut queue = lock(&self.queue);
                loop {
                    match queue.pop_front() {
                        Some(task) => break task,
                        None => queue = self.ready.wait(queue).unwrap_or_else(PoisonError::into_inner),
                    }
                }
            };
            self.queued.fetch_sub(1, Ordering::Release);
            task.call.run_part(task.part);
        }
    }
}

/// Calls `f(0)`, ..., `f(parts - 1)`, each once, in parallel: part 0 on the calling thread, the
/// others on pool workers (or on the calling thread, for those no worker has started when it is
/// done with its own). Returns when all are done; re-raises the first panic of one.
pub(crate) fn run(parts: usize, f: &(dyn Fn(usize) + Sync)) {
    if parts <= 1 {
        if parts == 1 {
            f(0);
        }
        return;
    }
    let pool = pool();
    pool.ensure_workers(parts - 1);
    // SAFETY (of erasing the lifetime): this function does not return, nor unwind, before every
    // part has run (the wait below), and `f` is not used after that.
    let f: *const (dyn Fn(usize) + Sync + '_) = f;
    let f: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(f) };
    let call = Arc::new(Call { f, state: Mutex::new((parts, None)), done: Condvar::new() });
    {
        let mut queue = lock(&pool.queue);
        queue.extend((1..parts).map(|part| Task { call: call.clone(), part }));
        pool.queued.fetch_add(parts - 1, Ordering::Release);
    }
    pool.ready.notify_all();
    call.run_part(0);
    // Parts still queued are ours to run now.
    let mine: VecDeque<Task> = {
        let mut queue = lock(&pool.queue);
        let (mine, others) = queue.drain(..).partition(|t: &Task| Arc::ptr_eq(&t.call, &call));
        *queue = others;
        pool.queued.fetch_sub(mine.len(), Ordering::Release);
        mine
    };
    for task in mine {
        call.run_part(task.part);
    }
    let mut state = lock(&call.state);
    while state.0 > 0 {
        state = call.done.wait(state).unwrap_or_else(PoisonError::into_inner);
    }
    if let Some(payload) = state.1.take() {
        drop(state);
        resume_unwind(payload);
    }
}

/// Below this many updates one thread is faster than sharing the work (waking a pool worker takes
/// microseconds, tens when it sleeps; one core does several updates per nanosecond).
const PARALLEL_WORK: usize = 1 << 19;

/// Threads for `work` updates cut into `parts` parts: one below [`PARALLEL_WORK`], else as many as
/// there are cores (and parts).
pub(crate) fn threads_for(work: usize, parts: usize) -> usize {
    if work < PARALLEL_WORK {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(parts)
    }
}

thread_local! {
    /// Scratch of the calling thread, reused by later calls (it does not grow with seqlen).
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `work` on `threads` threads (the calling one and pool workers, see [`run`]), each with its
/// own 64-byte-aligned scratch of `floats` floats (contents undefined). Scratch is one allocation
/// kept by the calling thread and reused by later calls.
pub(crate) fn in_parallel(threads: usize, floats: usize, work: impl Fn(&mut [f32]) + Sync) {
    // 16 spare floats to align the first piece.
    let per_thread = floats.next_multiple_of(16).max(16);
    let needed = per_thread * threads + 16;
    let mut own = Vec::new();
    SCRATCH.with(|cell| {
        // A nested call on this thread (not expected) would find the cell borrowed: it then
        // allocates for itself.
        let mut guard = cell.try_borrow_mut();
        let buf = match guard.as_deref_mut() {
            Ok(buf) => buf,
            Err(_) => &mut own,
        };
        if buf.len() < needed {
            *buf = vec![0f32; needed];
        }
        let skip = buf.as_ptr().align_offset(64).min(16);
        // One piece per part; each lock is taken once, by the part's thread.
        let pieces: Vec<Mutex<&mut [f32]>> =
            buf[skip..].chunks_exact_mut(per_thread).take(threads).map(Mutex::new).collect();
        run(threads, &|part| work(&mut pieces[part].lock().unwrap_or_else(PoisonError::into_inner)));
    });
}

/// Takes the next `len` floats of `buf`.
pub(crate) fn take<'a>(buf: &mut &'a mut [f32], len: usize) -> &'a mut [f32] {
    let (head, tail) = std::mem::take(buf).split_at_mut(len);
    *buf = tail;
    head
}

/// The same, as `len` lane vectors.
pub(crate) fn take_lanes<'a, const W: usize>(buf: &mut &'a mut [f32], len: usize) -> &'a mut [[f32; W]] {
    take(buf, len * W).as_chunks_mut::<W>().0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_once() {
        for parts in [0, 1, 2, 3, 8, 33] {
            let counts: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
            run(parts, &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "parts {parts}");
        }
    }

    #[test]
    fn parts_run_on_other_threads() {
        let caller = std::thread::current().id();
        let others = AtomicUsize::new(0);
        // The caller's part waits (up to 10 s) for a worker to run another one.
        run(3, &|part| {
            if std::thread::current().id() != caller {
                others.fetch_add(1, Ordering::Relaxed);
            } else if part == 0 {
                let start = std::time::Instant::now();
                while others.load(Ordering::Relaxed) == 0 && start.elapsed().as_secs() < 10 {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        });
        assert!(others.load(Ordering::Relaxed) > 0, "no part ran on a pool worker");
    }

    #[test]
    fn concurrent_calls_and_panics() {
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for round in 0..50 {
                        let sum = AtomicUsize::new(0);
                        run(3, &|i| {
                            sum.fetch_add(i + 1, Ordering::Relaxed);
                        });
                        assert_eq!(sum.load(Ordering::Relaxed), 6, "thread {t} round {round}");
                    }
                });
            }
        });
        let finished = AtomicUsize::new(0);
        let result = catch_unwind(AssertUnwindSafe(|| {
            run(3, &|i| {
                if i == 2 {
                    panic!("part 2 fails");
                }
                finished.fetch_add(1, Ordering::Relaxed);
            })
        }));
        let payload = result.expect_err("the panic of part 2 reaches the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"part 2 fails"));
        assert_eq!(finished.load(Ordering::Relaxed), 2);
        // The pool still works after a panic.
        let n = AtomicUsize::new(0);
        run(2, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }
}
