//! Process-wide values that a child made by `fork` makes anew. The Python reader runs in
//! DataLoader workers forked from a process that may have read already: the parent's
//! threads are not in the child (a queue they served would wait forever), its pooled
//! connections are not the child's to use, and a lock one of its threads held at the
//! fork is never released there.

use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::Once;

/// How many forks this process is from the one that first used a [`PerProcess`].
static GENERATION: AtomicU64 = AtomicU64::new(0);

extern "C" fn forked() {
    GENERATION.fetch_add(1, Ordering::AcqRel);
}

/// How many forks this process is from the first that asked: a value kept from before
/// a fork tells it is the parent's by this.
pub fn generation() -> u64 {
    static HOOK: Once = Once::new();
    // SAFETY: registers a handler that only bumps an atomic (async-signal-safe).
    HOOK.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(forked));
    });
    GENERATION.load(Ordering::Acquire)
}

/// A value made on first use in each process, never freed (the parent's is left to it).
pub struct PerProcess<T: 'static> {
    slot: AtomicPtr<Slot<T>>,
}

struct Slot<T> {
    generation: u64,
    value: T,
}

impl<T: Send + Sync + 'static> PerProcess<T> {
    pub const fn new() -> Self {
        PerProcess {
            slot: AtomicPtr::new(std::ptr::null_mut()),
        }
    }

    /// This process's value, and whether this call made it: `make` must be cheap and
    /// start nothing (two threads may race to make it), so what goes with a new value
    /// (its threads) is started by the caller that gets `true`.
    pub fn get_or_make(&self, make: impl Fn() -> T) -> (&'static T, bool) {
        let now = generation();
        loop {
            let cur = self.slot.load(Ordering::Acquire);
            // SAFETY: slots are leaked, never freed, once published.
            if let Some(s) = unsafe { cur.as_ref() } {
                if s.generation == now {
                    return (&s.value, false);
                }
            }
            let mine = Box::into_raw(Box::new(Slot {
                generation: now,
                value: make(),
            }));
            match self
                .slot
                .compare_exchange(cur, mine, Ordering::AcqRel, Ordering::Acquire)
            {
                // SAFETY: published: leaked from here on.
                Ok(_) => return (unsafe { &(*mine).value }, true),
                // SAFETY: never published: ours alone to free.
                Err(_) => drop(unsafe { Box::from_raw(mine) }),
            }
        }
    }

    /// This process's value.
    pub fn get(&self, make: impl Fn() -> T) -> &'static T {
        self.get_or_make(make).0
    }
}

impl<T: Send + Sync + 'static> Default for PerProcess<T> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_makes_its_own_and_the_parent_keeps_its() {
        static V: PerProcess<crate::sync::Mutex<u32>> = PerProcess::new();
        let (first, made) = V.get_or_make(|| crate::sync::Mutex::new(7));
        assert!(made);
        *first.lock() = 8;
        let held = first.lock(); // held across the fork, as a parent thread might
                                 // SAFETY: the child only touches atomics, a new mutex and then _exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let (v, made) = V.get_or_make(|| crate::sync::Mutex::new(7));
            let ok = made && *v.lock() == 7;
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        drop(held);
        let mut status = 0;
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "the child got the parent's value"
        );
        let (again, made) = V.get_or_make(|| crate::sync::Mutex::new(7));
        assert!(!made);
        assert_eq!(*again.lock(), 8);
    }
}
