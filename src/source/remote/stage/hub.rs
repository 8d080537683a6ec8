//! The node's copies, found by what they are copies of. One process of the user's job on
//! the node holds the hub (an abstract socket, [`crate::node`]) and the descriptor of
//! every copy made; every other process that reads a copy, or has its object open,
//! keeps one connection to it. A process asks for the copy of an object (`want`); the
//! hub answers with its descriptor or says there is none, and from then on hands it to
//! that process as soon as some process makes it (`have`). So a rank that only opened
//! the object, while its DataLoader workers made and read the copy, holds the copy for
//! the workers of the next epoch.
//!
//! The hub goes with its process. Its peers see their connection end: one of them takes
//! the name, the others connect to it and offer again what they hold, so the copies live
//! while any process holds them and are gone with the last, however each ends.
//!
//! The hub also counts the node's reads of files of each object wanted (`seen`), and
//! tells the process whose read makes them [`START_AFTER`] to make the copy (`start`):
//! the node's first epoch, not each process's, starts it, so sixteen processes do not
//! each fetch their first files alone first.
//!
//! Messages are one line, `want ID`, `have ID` (with the descriptor), `copy ID` (with
//! it), `none ID`, `seen ID` or `start ID`, where ID is the object's identity with no
//! newline in it.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::node::{self, Sock};
use crate::per_process::PerProcess;
use crate::sync::{Condvar, Mutex};

/// How long an answer from the hub may take before this process goes on alone.
const ANSWER: Duration = Duration::from_secs(10);
/// The longest message: a line with an identity (a URL, an ETag, numbers).
const LINE: usize = 8192;

/// Where a copy of one object arrives in this process.
pub type Slot = Arc<OnceLock<File>>;

/// What makes this process's copy of an object, when the hub says so.
pub type Starter = Arc<dyn Fn() + Send + Sync>;

/// Reads of files of an object, over the node, after which its copy is made: the
/// preload's rule for a local archive, for the node.
pub const START_AFTER: u64 = super::super::AUTO_AFTER_READS;

/// This process's side: the hub itself, or a connection to it.
struct Hub {
    name: String,
    state: Mutex<State>,
    answered: Condvar,
    /// Written to wake the poll thread when what it polls changed (without one, the
    /// thread looks again every 100 ms).
    wake: Option<OwnedFd>,
}

#[derive(Default)]
struct State {
    /// Copies by identity: those this process wants, and, being the hub, those its
    /// peers want. The hub lets a copy go when no process wants it any more.
    slots: HashMap<String, Slot>,
    /// How many objects of this process's want each identity.
    mine: HashMap<String, usize>,
    role: Role,
    /// Identities the hub answered since this process asked.
    answered: HashSet<String>,
    /// What makes the copy of each object this process may copy.
    starters: HashMap<String, Starter>,
    /// Being the hub: reads of each object's files seen on the node, until started.
    counts: HashMap<String, u64>,
}

#[derive(Default)]
enum Role {
    /// Neither: no copy wanted yet, or the hub could not be reached.
    #[default]
    Alone,
    Member(Sock),
    Serving {
        listener: Sock,
        peers: Vec<Peer>,
    },
}

struct Peer {
    conn: Sock,
    wants: Vec<String>,
}

fn hub() -> &'static Hub {
    static HUB: PerProcess<Hub> = PerProcess::new();
    let (hub, made) = HUB.get_or_make(|| {
        // SAFETY: eventfd makes a new descriptor; checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        Hub {
            name: node::name("copies", "hub"),
            state: Mutex::new(State::default()),
            answered: Condvar::new(),
            // SAFETY: a new descriptor nothing else owns.
            wake: (fd >= 0).then(|| unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }),
        }
    });
    if made {
        let _ = std::thread::Builder::new()
            .name("archfs-hub".into())
            .spawn(move || hub.poll_loop());
    }
    hub
}

/// Whether some process of the job on the node holds the hub: a local file looks for
/// node copies only then, so opening one starts no hub of its own.
pub fn running() -> bool {
    matches!(node::connect(&node::name("copies", "hub")), Ok(Some(_)))
}

/// The node's copy of `id`, if one exists; from now on a copy made by any process arrives
/// in the slot returned.
pub fn want(id: &str) -> Slot {
    *hub().state.lock().mine.entry(id.to_owned()).or_default() += 1;
    slot(id)
}

/// The slot of `id`, asked of the hub when new here.
fn slot(id: &str) -> Slot {
    let hub = hub();
    let mut st = hub.state.lock();
    if let Some(slot) = st.slots.get(id) {
        return slot.clone();
    }
    let slot = Slot::default();
    st.slots.insert(id.to_owned(), slot.clone());
    drop(st);
    hub.ask(id, &slot);
    slot
}

/// An object of this process's that wanted `id` is gone; the last lets the copy go here
/// (and at the hub once no process wants it).
pub fn unwant(id: &str) {
    let hub = hub();
    let mut st = hub.state.lock();
    let st = &mut *st;
    match st.mine.get_mut(id) {
        Some(n) if *n > 1 => {
            *n -= 1;
            return;
        }
        Some(_) => {
            st.mine.remove(id);
        }
        None => return,
    }
    st.starters.remove(id);
    match &mut st.role {
        Role::Serving { peers, .. } => prune(&mut st.slots, &st.mine, &mut st.counts, peers, id),
        Role::Member(conn) => {
            let _ = send(conn, &format!("unwant {id}"), None);
            st.slots.remove(id);
        }
        Role::Alone => {
            st.slots.remove(id);
        }
    }
}

/// Being the hub: lets the copy of `id` go when neither this process nor a peer wants it.
fn prune(
    slots: &mut HashMap<String, Slot>,
    mine: &HashMap<String, usize>,
    counts: &mut HashMap<String, u64>,
    peers: &[Peer],
    id: &str,
) {
    if !mine.contains_key(id) && !peers.iter().any(|p| p.wants.iter().any(|w| w == id)) {
        slots.remove(id);
        counts.remove(id);
    }
}

/// Registers what makes this process's copy of `id` when the node's reads show an
/// epoch.
pub fn on_start(id: &str, starter: Starter) {
    hub().state.lock().starters.insert(id.to_owned(), starter);
}

/// A read of a file of `id` in this process (sent for its first [`START_AFTER`] only).
pub fn seen(id: &str) {
    let hub = hub();
    let mut st = hub.state.lock();
    let st = &mut *st;
    match &st.role {
        Role::Alone => {}
        Role::Member(conn) => {
            let _ = send(conn, &format!("seen {id}"), None);
        }
        Role::Serving { .. } => {
            if count(&mut st.counts, &st.slots, id) {
                start(st.starters.get(id));
            }
        }
    }
}

/// Counts a read of `id` on the node; true for the read that should start its copy.
fn count(counts: &mut HashMap<String, u64>, slots: &HashMap<String, Slot>, id: &str) -> bool {
    let n = counts.entry(id.to_owned()).or_default();
    *n += 1;
    *n == START_AFTER && slots.get(id).is_none_or(|s| s.get().is_none())
}

/// Runs `starter` on a thread of its own (making a copy waits on the node's lock).
fn start(starter: Option<&Starter>) {
    if let Some(f) = starter.cloned() {
        let _ = std::thread::Builder::new()
            .name("archfs-stage-start".into())
            .spawn(move || f());
    }
}

/// The node's copy of `id`: the one some process made, else the one `make` makes, given
/// to every process that wants it. Runs under the node's lock on placing copies, so two
/// processes never make the same one.
pub fn make_or_join(id: &str, make: impl FnOnce() -> Option<File>) -> Option<Slot> {
    let slot = slot(id);
    if slot.get().is_some() {
        return Some(slot);
    }
    let _lock = node::NodeLock::take(super::place::LOCK, Duration::from_secs(60));
    let hub = hub();
    hub.ask(id, &slot); // made while we waited for the lock?
    if slot.get().is_some() {
        return Some(slot);
    }
    let file = make()?;
    let offered = file.try_clone().ok();
    let _ = slot.set(file);
    if let Some(f) = offered {
        hub.offer(id, f);
    }
    Some(slot)
}

/// Holds `file` as this process's copy of `id` and offers it to the node (a forked
/// child keeping what its parent had).
pub fn hold(id: &str, file: File) {
    let slot = slot(id);
    if slot.get().is_none() {
        if let Ok(offered) = file.try_clone() {
            let _ = slot.set(file);
            hub().offer(id, offered);
        }
    }
}

impl Hub {
    /// Asks the hub for `id`'s copy into `slot`, joining or taking the hub first.
    fn ask(&self, id: &str, slot: &Slot) {
        let mut st = self.state.lock();
        if matches!(st.role, Role::Alone) {
            st.role = self.join();
            self.poke();
        }
        st.answered.remove(id);
        let sent = match &st.role {
            // Being the hub, its slots are the node's copies.
            Role::Alone | Role::Serving { .. } => return,
            Role::Member(conn) => send(conn, &format!("want {id}"), None),
        };
        if sent.is_err() {
            return;
        }
        let deadline = std::time::Instant::now() + ANSWER;
        loop {
            if slot.get().is_some() || st.answered.remove(id) {
                return;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                tracing::warn!("the node's hub of copies did not answer; going on alone");
                return;
            }
            st = self.answered.wait_timeout(st, deadline - now);
        }
    }

    /// Tells the hub (or, being it, the peers that want it) of a copy of `id`.
    fn offer(&self, id: &str, file: File) {
        let mut st = self.state.lock();
        match &mut st.role {
            Role::Alone => {}
            Role::Member(conn) => {
                let _ = send(conn, &format!("have {id}"), Some(file.as_raw_fd()));
            }
            Role::Serving { peers, .. } => hand_out(peers, id, &file),
        }
    }

    /// Connects to the hub, or takes it when no process holds it.
    fn join(&self) -> Role {
        for _ in 0..100 {
            match node::connect(&self.name) {
                Ok(Some(conn)) => return Role::Member(conn),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!("cannot share copies with this job's other processes: {e}");
                    return Role::Alone;
                }
            }
            match node::listen(&self.name) {
                Ok(Some(listener)) => {
                    node::nonblocking(&listener);
                    return Role::Serving {
                        listener,
                        peers: Vec::new(),
                    };
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(2)), // bound, not listening yet
                Err(e) => {
                    tracing::warn!("cannot share copies with this job's other processes: {e}");
                    return Role::Alone;
                }
            }
        }
        Role::Alone
    }

    fn poke(&self) {
        let one = 1u64.to_ne_bytes();
        if let Some(w) = &self.wake {
            // SAFETY: writes 8 bytes to our eventfd.
            unsafe { libc::write(w.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
    }

    /// Serves the hub's listener and peers, or watches the connection to the hub.
    fn poll_loop(&self) {
        loop {
            // A negative descriptor is skipped by poll.
            let wake = self.wake.as_ref().map_or(-1, |w| w.as_raw_fd());
            let mut fds = vec![pollfd(wake)];
            {
                let st = self.state.lock();
                match &st.role {
                    Role::Alone => {}
                    Role::Member(conn) => fds.push(pollfd(conn.as_raw_fd())),
                    Role::Serving { listener, peers } => {
                        fds.push(pollfd(listener.as_raw_fd()));
                        fds.extend(peers.iter().map(|p| pollfd(p.conn.as_raw_fd())));
                    }
                }
            }
            // SAFETY: `fds` is a valid array of pollfd for the length given.
            let timeout = if wake < 0 { 100 } else { -1 };
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as _, timeout) };
            if n < 0 {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            if fds[0].revents != 0 {
                let mut buf = [0u8; 8];
                // SAFETY: reads 8 bytes from our eventfd.
                unsafe { libc::read(wake, buf.as_mut_ptr().cast(), 8) };
            }
            let ready: Vec<RawFd> = fds[1..]
                .iter()
                .filter(|p| p.revents != 0)
                .map(|p| p.fd)
                .collect();
            for fd in ready {
                self.on_ready(fd);
            }
        }
    }

    fn on_ready(&self, fd: RawFd) {
        let mut st = self.state.lock();
        let st = &mut *st;
        let State {
            slots,
            mine,
            role,
            counts,
            ..
        } = &mut *st;
        match role {
            Role::Alone => {}
            Role::Member(conn) if conn.as_raw_fd() == fd => match receive(conn) {
                Some((line, file)) => self.heard(st, &line, file),
                _ => self.take_over(st),
            },
            Role::Member(_) => {}
            Role::Serving { listener, peers } if listener.as_raw_fd() == fd => {
                while let Ok(Some((conn, _pid))) = node::accept(listener) {
                    peers.push(Peer {
                        conn,
                        wants: Vec::new(),
                    });
                }
            }
            Role::Serving { peers, .. } => {
                let Some(i) = peers.iter().position(|p| p.conn.as_raw_fd() == fd) else {
                    return;
                };
                match receive(&peers[i].conn) {
                    Some((line, file)) => serve(slots, mine, counts, peers, i, &line, file),
                    _ => {
                        let gone = peers.swap_remove(i);
                        for id in &gone.wants {
                            prune(slots, mine, counts, peers, id);
                        }
                    }
                }
            }
        }
    }

    /// A message from the hub.
    fn heard(&self, st: &mut State, line: &str, file: Option<File>) {
        let (verb, id) = line.split_once(' ').unwrap_or((line, ""));
        if let ("copy", Some(f)) = (verb, file) {
            if let Some(slot) = st.slots.get(id) {
                let _ = slot.set(f);
            }
        }
        if matches!(verb, "copy" | "none") {
            st.answered.insert(id.to_owned());
        }
        if verb == "start" {
            start(st.starters.get(id));
        }
        self.answered.notify_all();
    }

    /// The hub's process ended: take the name, or join who took it, and offer what this
    /// process holds so later processes find it.
    fn take_over(&self, st: &mut State) {
        st.role = Role::Alone;
        st.role = self.join();
        if let Role::Serving { .. } = &st.role {
            // Its own slots are the node's copies now: a question asked of the hub that
            // ended has its answer.
            let ids: Vec<String> = st.slots.keys().cloned().collect();
            st.answered.extend(ids);
        }
        if let Role::Member(conn) = &st.role {
            for (id, slot) in &st.slots {
                let sent = match slot.get() {
                    Some(f) => send(conn, &format!("have {id}"), Some(f.as_raw_fd())),
                    None => send(conn, &format!("want {id}"), None),
                };
                if sent.is_err() {
                    break;
                }
            }
        }
        self.answered.notify_all();
    }
}

/// The hub answers peer `i`'s message.
fn serve(
    slots: &mut HashMap<String, Slot>,
    mine: &HashMap<String, usize>,
    counts: &mut HashMap<String, u64>,
    peers: &mut [Peer],
    i: usize,
    line: &str,
    file: Option<File>,
) {
    let (verb, id) = line.split_once(' ').unwrap_or((line, ""));
    match (verb, file) {
        ("seen", _) if count(counts, slots, id) => {
            let _ = send(&peers[i].conn, &format!("start {id}"), None);
        }
        ("want", _) => {
            if !peers[i].wants.iter().any(|w| w == id) {
                peers[i].wants.push(id.to_owned());
            }
            let held = slots.get(id).and_then(|s| s.get());
            let _ = match held {
                Some(f) => send(&peers[i].conn, &format!("copy {id}"), Some(f.as_raw_fd())),
                None => send(&peers[i].conn, &format!("none {id}"), None),
            };
        }
        ("unwant", _) => {
            peers[i].wants.retain(|w| w != id);
            prune(slots, mine, counts, peers, id);
        }
        ("have", Some(f)) => {
            if !peers[i].wants.iter().any(|w| w == id) {
                peers[i].wants.push(id.to_owned());
            }
            let slot = slots.entry(id.to_owned()).or_default();
            if slot.get().is_none() {
                let _ = slot.set(f);
                if let Some(f) = slot.get() {
                    hand_out(peers, id, f);
                }
            }
        }
        _ => {}
    }
}

/// Hands the copy of `id` to every peer that wants it.
fn hand_out(peers: &[Peer], id: &str, file: &File) {
    for p in peers.iter().filter(|p| p.wants.iter().any(|w| w == id)) {
        let _ = send(&p.conn, &format!("copy {id}"), Some(file.as_raw_fd()));
    }
}

fn send(conn: &Sock, line: &str, fd: Option<RawFd>) -> std::io::Result<()> {
    node::send(conn, line.trim_end().as_bytes(), fd.as_slice())
}

/// One message and the descriptor with it; `None` when the other end is gone.
fn receive(conn: &Sock) -> Option<(String, Option<File>)> {
    let mut buf = vec![0u8; LINE];
    match node::recv(conn, &mut buf) {
        Ok((n, fds)) if n > 0 => Some((
            String::from_utf8_lossy(&buf[..n]).into_owned(),
            fds.into_iter().next().map(File::from),
        )),
        _ => None,
    }
}

fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}
