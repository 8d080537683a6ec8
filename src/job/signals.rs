//! Signals and the other things a serving loop waits for, as [`Event`]s on one channel:
//! blocked signals taken by one thread, the `--exit-with` owner's end, a `--shared`
//! mount's last user leaving; and the clean signal state `run` gives its command.

use std::sync::mpsc::Sender;
use std::time::Duration;

use super::mountpoint;
use super::shared::Registry;
use super::{Event, JobError};

fn sigset(signals: &[i32]) -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and fill a plain sigset_t.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &s in signals {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Blocks `signals` in this thread and every thread it starts later, so only
/// [`watch_signals`] takes them; call it before any thread exists.
pub fn block_signals(signals: &[i32]) {
    let set = sigset(signals);
    // SAFETY: set is initialised; a null old-set pointer is allowed.
    unsafe {
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Delivers the blocked `signals` as events, with whether a process sent them.
pub fn watch_signals(signals: &[i32], events: Sender<Event>) {
    let set = sigset(signals);
    std::thread::Builder::new()
        .name("archfs-signals".into())
        .spawn(move || loop {
            // SAFETY: info is plain data the kernel fills in; set is initialised.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            let signo = unsafe { libc::sigwaitinfo(&set, &mut info) };
            if signo < 0 {
                continue;
            }
            let from_process = matches!(
                info.si_code,
                libc::SI_USER | libc::SI_QUEUE | libc::SI_TKILL
            );
            let event = Event::Signal {
                signo,
                from_process,
            };
            if events.send(event).is_err() {
                return;
            }
        })
        .expect("spawn the signal thread");
}

/// Sends `Event::OwnerEnded` once process `pid` has ended: its pidfd (Linux 5.3+) turns
/// readable, or, on older kernels, polling sees it gone or a zombie.
pub fn watch_owner(pid: i32, events: Sender<Event>) -> Result<(), JobError> {
    let gone = move || mountpoint::start_time(pid).is_none();
    if gone() {
        return Err(JobError::NoOwner(pid));
    }
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
    std::thread::Builder::new()
        .name("archfs-owner".into())
        .spawn(move || {
            if pidfd >= 0 {
                let mut p = libc::pollfd {
                    fd: pidfd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: p is one valid pollfd; -1 waits without a timeout.
                while unsafe { libc::poll(&mut p, 1, -1) } < 0 {}
            } else {
                while !gone() {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            let _ = events.send(Event::OwnerEnded(pid));
        })
        .map_err(|e| JobError::system("start a thread", e))?;
    Ok(())
}

/// Sends `Event::Unused`, with the registry locked, once no user of a `--shared` mount is
/// left; looks every 100 ms.
pub fn watch_users(registry: Registry, events: Sender<Event>) -> Result<(), JobError> {
    std::thread::Builder::new()
        .name("archfs-users".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_millis(100));
            let Ok(lock) = registry.lock() else {
                continue;
            };
            if registry.live_users(&lock) == 0 {
                let _ = events.send(Event::Unused(lock));
                return;
            }
        })
        .map(drop)
        .map_err(|e| JobError::system("start a thread", e))
}

/// In the command's process, between fork and exec: an empty signal mask and the
/// default action for every signal, whatever `run` blocked or inherited ignored (a
/// shell starts background jobs with SIGINT and SIGQUIT ignored). Exec keeps both.
pub fn reset_signals() {
    // The kernel's sigaction, all zero: SIG_DFL, no flags, an empty mask. Called raw
    // because glibc refuses the signals it reserves (32, 33), which can still arrive
    // ignored from a parent (seen under cargo-nextest).
    let dfl = [0u64; 4];
    for sig in 1..=64 {
        // SAFETY: rt_sigaction reads `dfl` (large enough for the kernel's struct, 8-byte
        // mask) and writes nothing; it is async-signal-safe. SIGKILL and SIGSTOP refuse.
        unsafe {
            libc::syscall(libc::SYS_rt_sigaction, sig, dfl.as_ptr(), 0usize, 8usize);
        }
    }
    let empty = sigset(&[]);
    // SAFETY: an initialised empty set; sigprocmask is async-signal-safe.
    unsafe { libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) };
}
