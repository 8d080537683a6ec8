//! Locks and condition variables that a child made by `fork` can use: the standard
//! library's, without poisoning, in the shape the rest of the crate calls them.
//!
//! Not parking_lot's: it parks waiting threads in one table for the whole process, a list
//! of each thread's record linked through the threads' own stacks. After a fork the
//! parent's parked threads are gone but still listed, and the child's first new threads
//! are given those threads' stacks back by glibc, so their records are linked in twice:
//! a DataLoader worker forked from a process that had read spun or slept forever at its
//! first contended lock (parking_lot#515). The standard library's locks are a futex in
//! each lock, nothing shared between them.
//!
//! A lock is taken even if a thread panicked holding it (as parking_lot did): what it
//! guards is kept consistent without relying on unwinding.

use std::sync::PoisonError;

pub use std::sync::{MutexGuard, RwLockReadGuard, RwLockWriteGuard};

#[derive(Debug, Default)]
pub struct Mutex<T: ?Sized>(std::sync::Mutex<T>);

impl<T> Mutex<T> {
    pub const fn new(value: T) -> Self {
        Mutex(std::sync::Mutex::new(value))
    }

    pub fn into_inner(self) -> T {
        self.0.into_inner().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T: ?Sized> Mutex<T> {
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn get_mut(&mut self) -> &mut T {
        self.0.get_mut().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Debug, Default)]
pub struct RwLock<T: ?Sized>(std::sync::RwLock<T>);

impl<T> RwLock<T> {
    pub const fn new(value: T) -> Self {
        RwLock(std::sync::RwLock::new(value))
    }
}

impl<T: ?Sized> RwLock<T> {
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Debug, Default)]
pub struct Condvar(std::sync::Condvar);

impl Condvar {
    pub const fn new() -> Self {
        Condvar(std::sync::Condvar::new())
    }

    /// Unlocks `guard`, sleeps until notified (or spuriously), and locks it again.
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.0.wait(guard).unwrap_or_else(PoisonError::into_inner)
    }

    /// As [`Condvar::wait`], for at most `timeout`.
    pub fn wait_timeout<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: std::time::Duration,
    ) -> MutexGuard<'a, T> {
        match self.0.wait_timeout(guard, timeout) {
            Ok((g, _)) => g,
            Err(e) => e.into_inner().0,
        }
    }

    pub fn notify_one(&self) {
        self.0.notify_one();
    }

    pub fn notify_all(&self) {
        self.0.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// Threads that wait on a condition variable and are woken, `n` of them, joined.
    fn park_and_wake(n: usize) {
        let shared = Arc::new((Mutex::new(0usize), Condvar::new()));
        let threads: Vec<_> = (0..n)
            .map(|_| {
                let shared = shared.clone();
                std::thread::spawn(move || {
                    let (count, cv) = &*shared;
                    let mut c = count.lock();
                    *c += 1;
                    cv.notify_all();
                    while *c < 2 * n {
                        c = cv.wait(c);
                    }
                })
            })
            .collect();
        let (count, cv) = &*shared;
        let mut c = count.lock();
        while *c < n {
            c = cv.wait(c);
        }
        *c = 2 * n;
        cv.notify_all();
        drop(c);
        threads.into_iter().for_each(|t| t.join().unwrap());
    }

    /// A thread that sleeps until the flag is set.
    fn sleep_until_done(asleep: &Arc<(Mutex<bool>, Condvar)>) -> std::thread::JoinHandle<()> {
        let asleep = asleep.clone();
        std::thread::spawn(move || {
            let (done, cv) = &*asleep;
            let mut d = done.lock();
            while !*d {
                d = cv.wait(d);
            }
        })
    }

    #[test]
    fn a_forked_child_parks_and_wakes_threads_where_the_parents_were_parked() {
        // Parent threads asleep on a lock at the fork, as a reader's helper threads are
        // when a DataLoader forks its workers.
        let asleep = Arc::new((Mutex::new(false), Condvar::new()));
        let sleepers: Vec<_> = (0..8).map(|_| sleep_until_done(&asleep)).collect();
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: the child runs threads of its own and leaves by _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // The child's threads sleep on the same lock (its copy of it) and are woken,
            // then on new ones.
            let woken: Vec<_> = (0..8).map(|_| sleep_until_done(&asleep)).collect();
            std::thread::sleep(Duration::from_millis(100));
            *asleep.0.lock() = true;
            asleep.1.notify_all();
            woken.into_iter().for_each(|t| t.join().unwrap());
            for _ in 0..20 {
                park_and_wake(8);
            }
            unsafe { libc::_exit(0) };
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut status = 0;
        let ended = loop {
            // SAFETY: our own child.
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                break true;
            }
            if Instant::now() > deadline {
                unsafe { libc::kill(pid, libc::SIGKILL) };
                unsafe { libc::waitpid(pid, &mut status, 0) };
                break false;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        *asleep.0.lock() = true;
        asleep.1.notify_all();
        sleepers.into_iter().for_each(|t| t.join().unwrap());
        assert!(ended, "the forked child's threads hung for 120 s");
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    }
}
