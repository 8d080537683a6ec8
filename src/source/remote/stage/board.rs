//! The copy's board: which pieces are copied, in flight or free, kept in the copy's own
//! file past its data and mapped shared by every process of the node that reads the
//! copy, so each sees what any has copied, a reader in one process waits (on a futex in
//! the board) for a piece another process is fetching, and the GETs of all processes
//! together stay within a few.
//!
//! A copy filled file by file in the order a job will read ([`super::order`]) is marked
//! by [`GRAIN`]s instead: a bit for "in the copy", one for "a GET of it is under way",
//! so a reader waits for a file the order is fetching rather than fetching it a second
//! time, and six naming the process whose GET it is, so the grains of one that ended
//! mid-GET are let go and no other's.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const MAGIC: u64 = u64::from_le_bytes(*b"archfsB7");

/// What the copy filled file by file is marked by: a file's bytes are fetched rounded
/// out to it, so a grain is never half in the copy (neighbouring files share one at
/// most, fetched with the same bytes by either).
pub const GRAIN: u64 = 4 << 10;

#[repr(C)]
struct Head {
    magic: u64,
    size: u64,
    pieces: u64,
    /// The object's identity, hashed: a kept copy is checked against it.
    tag: u64,
    /// Nonzero once a kept copy's data is on the disk whole ([`super::keep`]).
    sealed: AtomicU32,
    /// Pieces not yet copied.
    left: AtomicU64,
    /// Where a copier starts looking for free pieces; all before it are taken.
    next: AtomicU64,
    /// Nonzero once the copy stopped on an error: readers fetch their own bytes.
    failed: AtomicU32,
    /// The places among [`Head::takers`] of the processes that fill the copy in the
    /// order their job reads, a bit each ([`UNNAMED`]'s for good): while one runs no
    /// process copies whole pieces, and a read of bytes not in the copy fetches just them.
    ordered: AtomicU64,
    /// Bumped at every arrival; the futex readers wait on.
    arrivals: AtomicU32,
    /// The processes copying, one entry a GET under way: their pids, 0 when free.
    copiers: [AtomicU32; COPIERS],
    /// The processes that took grains (a GET of them under way), 0 when free; a grain
    /// under way names its taker's place here ([`OWNER_BITS`]), so the grains of one
    /// that ended are let go ([`Board::free_grains_of_the_dead`]).
    takers: [AtomicU32; TAKERS],
    /// Bytes of grains in the copy: how fast an order brings it.
    landed: AtomicU64,
}

/// Processes of a node that fill one copy in order and are watched for their end. Past
/// them a process's grains are named by no place ([`UNNAMED`]) and never let go: a read
/// of them stalled fetches its own bytes after [`super::STALL`] x 4.
const TAKERS: usize = 63;
/// How often a process looks whether the processes that fill a copy in order still run.
const LOOK_ORDERS: Duration = Duration::from_secs(1);
/// Bitmaps naming the place among [`Head::takers`] of a grain's taker.
const OWNER_BITS: usize = 6;
/// The owner of grains taken while every place was held by a live process.
const UNNAMED: usize = TAKERS;
/// A taker's place while the grains of the process that ended in it are let go.
const FREEING: u32 = u32::MAX;

/// Bitmaps of grains: in the copy, under way, their taker's place.
const MAPS: usize = 2 + OWNER_BITS;

/// GETs of one copy under way at once, for all processes of the node.
pub const COPIERS: usize = 8;

/// What a piece is: free, taken by a process (not yet arriving, or arriving), or in the
/// copy. Kept in one u64: the state in the high half, the owner's pid in the low.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Not copied and not taken: a read of it fetches its own bytes.
    Free,
    /// Taken for a GET under way, not yet arriving: as [`Piece::Free`] for readers.
    Taken(u32),
    /// Arriving now: a read of its bytes near the front waits for them.
    Arriving(u32),
    Copied,
}

const COPIED: u64 = u64::MAX;

impl Piece {
    fn encode(self) -> u64 {
        match self {
            Piece::Free => 0,
            Piece::Taken(pid) => 1 << 32 | u64::from(pid),
            Piece::Arriving(pid) => 2 << 32 | u64::from(pid),
            Piece::Copied => COPIED,
        }
    }

    fn decode(v: u64) -> Piece {
        match (v >> 32, v as u32) {
            _ if v == COPIED => Piece::Copied,
            (1, pid) => Piece::Taken(pid),
            (2, pid) => Piece::Arriving(pid),
            _ => Piece::Free,
        }
    }

    /// The process that holds it.
    pub fn owner(self) -> Option<u32> {
        match self {
            Piece::Taken(p) | Piece::Arriving(p) => Some(p),
            _ => None,
        }
    }
}

/// Grains one process took for a GET ([`Board::take_grains`]): the bitmap words'
/// bits, and the first grain and the end of them all.
#[derive(Debug)]
pub struct Grains {
    words: Vec<(usize, u64)>,
    pub first: u64,
    pub end: u64,
}

impl Grains {
    /// The runs of grains taken, `[first, end)` each, those less than `gap` grains apart
    /// joined (a GET's round trip costs more than a few grains fetched again).
    pub fn runs(&self, gap: u64) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for &(w, mine) in &self.words {
            let mut bits = mine;
            while bits != 0 {
                let from = u64::from(bits.trailing_zeros());
                let len = u64::from((bits >> from).trailing_ones());
                let (a, b) = (w as u64 * 64 + from, w as u64 * 64 + from + len);
                match runs.last_mut() {
                    Some(last) if a <= last.1 + gap => last.1 = b,
                    _ => runs.push((a, b)),
                }
                bits &= !((u64::MAX >> (64 - len)) << from);
            }
        }
        runs
    }
}

/// A board mapped into this process.
#[derive(Debug)]
pub struct Board {
    file: File,
    base: *mut u8,
    len: usize,
    /// When this process last looked whether the processes of [`Head::ordered`] run, in
    /// milliseconds from `mapped`.
    looked: AtomicU64,
    mapped: Instant,
}

// SAFETY: the mapping is only reached through atomics and the immutable head fields.
unsafe impl Send for Board {}
unsafe impl Sync for Board {}

impl Board {
    /// The head, then three words a piece: its state, its bytes arrived, the first
    /// piece of the GET that took it; then the grains' bitmaps: in the copy, under way,
    /// and the [`OWNER_BITS`] of their taker's place.
    fn bytes(size: u64, pieces: u64) -> usize {
        std::mem::size_of::<Head>() + 24 * pieces as usize + 8 * MAPS * Self::words(size)
    }

    /// Words of one bitmap of grains.
    fn words(size: u64) -> usize {
        size.div_ceil(GRAIN).div_ceil(64) as usize
    }

    /// Where the board of a copy of `size` bytes starts: past the data, at a boundary of
    /// the largest page size (64 KiB on some aarch64 kernels).
    fn start(size: u64) -> u64 {
        size.div_ceil(64 << 10) * (64 << 10)
    }

    /// The length of the file holding a copy of `size` bytes in `pieces` and its board.
    pub fn file_len(size: u64, pieces: u64) -> u64 {
        Self::start(size) + Self::bytes(size, pieces) as u64
    }

    /// A new board in `file` (of [`Board::file_len`]), for a copy of `size` bytes in
    /// `pieces` pieces, all free.
    pub fn create(file: File, size: u64, pieces: u64, tag: u64) -> io::Result<Board> {
        let len = Self::bytes(size, pieces);
        let board = Board::map(file, Self::start(size), len)?;
        // SAFETY: a fresh mapping of `len` zeroed bytes, the head at its start, no other
        // process holding it yet.
        unsafe {
            let head = board.base as *mut Head;
            (*head).size = size;
            (*head).pieces = pieces;
            (*head).tag = tag;
            (*head).left = AtomicU64::new(pieces);
            std::sync::atomic::fence(Ordering::Release);
            (*head).magic = MAGIC;
        }
        Ok(board)
    }

    /// The board another process made, for a copy of `size` bytes.
    pub fn open(file: File, size: u64) -> io::Result<Board> {
        let bad = || io::Error::new(io::ErrorKind::InvalidData, "not a copy of this object");
        let at = Self::start(size);
        let len = file.metadata()?.len().checked_sub(at).ok_or_else(bad)?;
        let len = usize::try_from(len).map_err(|_| bad())?;
        if len < std::mem::size_of::<Head>() {
            return Err(bad());
        }
        let board = Board::map(file, at, len)?;
        let h = board.head();
        // A share's copy has its spans past the board ([`super::spans`]).
        if h.magic != MAGIC || h.size != size || Self::bytes(size, h.pieces) > len {
            return Err(bad());
        }
        Ok(board)
    }

    fn map(file: File, at: u64, len: usize) -> io::Result<Board> {
        // SAFETY: maps `len` bytes at `at` (page-aligned) of a file at least that long.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                at as libc::off_t,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Board {
            file,
            base: base.cast(),
            len,
            looked: AtomicU64::new(0),
            mapped: Instant::now(),
        })
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    fn head(&self) -> &Head {
        // SAFETY: the mapping starts with a Head and lives as long as self.
        unsafe { &*(self.base as *const Head) }
    }

    fn slot(&self, i: usize) -> &AtomicU64 {
        // SAFETY: slots follow the head, 8-byte aligned, within the mapping (3 per piece).
        unsafe { &*(self.base.add(std::mem::size_of::<Head>() + 8 * i) as *const AtomicU64) }
    }

    pub fn pieces(&self) -> u64 {
        self.head().pieces
    }

    pub fn tag(&self) -> u64 {
        self.head().tag
    }

    pub fn sealed(&self) -> bool {
        self.head().sealed.load(Ordering::Acquire) != 0
    }

    /// Marks the copy whole on the disk (after its data was synced), synced in turn.
    pub fn seal(&self) {
        self.head().sealed.store(1, Ordering::Release);
        // SAFETY: msync of exactly the mapping `map` made.
        unsafe { libc::msync(self.base.cast(), self.len, libc::MS_SYNC) };
    }

    /// Whether a live process copies into it, or holds a piece of it.
    pub fn in_use(&self) -> bool {
        let copier = self.head().copiers.iter().any(|c| {
            let pid = c.load(Ordering::Acquire);
            pid != 0 && alive(pid)
        });
        copier || (0..self.pieces()).any(|p| self.piece(p).owner().is_some_and(alive))
    }

    pub fn piece(&self, p: u64) -> Piece {
        Piece::decode(self.slot(p as usize).load(Ordering::Acquire))
    }

    /// Moves piece `p` from `from` to `to`; false when it was not `from`.
    pub fn swap(&self, p: u64, from: Piece, to: Piece) -> bool {
        self.slot(p as usize)
            .compare_exchange(
                from.encode(),
                to.encode(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// Bytes of arriving piece `p` in the copy, from its start.
    pub fn filled(&self, p: u64) -> &AtomicU64 {
        self.slot((self.pieces() + p) as usize)
    }

    /// The first piece of the GET that took piece `p`.
    pub fn run(&self, p: u64) -> &AtomicU64 {
        self.slot((2 * self.pieces() + p) as usize)
    }

    pub fn left(&self) -> &AtomicU64 {
        &self.head().left
    }

    pub fn next(&self) -> &AtomicU64 {
        &self.head().next
    }

    pub fn failed(&self) -> bool {
        self.head().failed.load(Ordering::Acquire) != 0
    }

    /// Whether a process fills the copy in the order its job reads. Whether those
    /// processes still run is looked at once in [`LOOK_ORDERS`] at most: once the last
    /// has ended (its rank killed) the copy is made of whole pieces again, else the
    /// mounts of the node would fetch what they read and never copy the rest.
    pub fn ordered(&self) -> bool {
        let held = self.head().ordered.load(Ordering::Acquire);
        if held == 0 {
            return false;
        }
        let now = self.mapped.elapsed().as_millis() as u64 + 1;
        let last = self.looked.load(Ordering::Relaxed);
        if (last != 0 && now.saturating_sub(last) < LOOK_ORDERS.as_millis() as u64)
            || self.looked.swap(now, Ordering::Relaxed) != last
        {
            return true;
        }
        let takers = &self.head().takers;
        let ended = (0..TAKERS).filter(|i| held >> i & 1 == 1).any(|i| {
            let pid = takers[i].load(Ordering::Acquire);
            pid != FREEING && !alive(pid)
        });
        if ended {
            self.free_grains_of_the_dead();
        }
        self.head().ordered.load(Ordering::Acquire) != 0
    }

    /// This process fills the copy in the order its job reads.
    pub fn set_ordered(&self) {
        self.set_ordered_for(std::process::id());
    }

    fn set_ordered_for(&self, pid: u32) {
        let place = self.note_taker(pid);
        self.head().ordered.fetch_or(1 << place, Ordering::AcqRel);
    }

    /// Word `w` of bitmap `map` (0: in the copy, 1: under way, 2..: the taker's place).
    fn grains(&self, map: usize, w: usize) -> &AtomicU64 {
        let at = std::mem::size_of::<Head>() + 24 * self.pieces() as usize;
        let words = Self::words(self.head().size);
        // SAFETY: the bitmaps follow the pieces' words, 8-byte aligned, within the
        // mapping ([`Board::bytes`]).
        unsafe { &*(self.base.add(at + 8 * (map * words + w)) as *const AtomicU64) }
    }

    /// The grains `[first, end)`, one bitmap word at a time: (word, mask of its bits).
    fn grain_words(first: u64, end: u64) -> impl Iterator<Item = (usize, u64)> {
        let mut g = first;
        std::iter::from_fn(move || {
            if g >= end {
                return None;
            }
            let (w, bit) = ((g / 64) as usize, g % 64);
            let n = (64 - bit).min(end - g);
            g += n;
            Some((w, (u64::MAX >> (64 - n)) << bit))
        })
    }

    /// Whether every grain of `[first, end)` is in the copy.
    pub fn grains_in(&self, first: u64, end: u64) -> bool {
        Self::grain_words(first, end)
            .all(|(w, mask)| self.grains(0, w).load(Ordering::Acquire) & mask == mask)
    }

    /// Whether some grain of `[first, end)` is in the copy, and whether some is under
    /// way.
    pub fn grains_touched(&self, first: u64, end: u64) -> (bool, bool) {
        Self::grain_words(first, end).fold((false, false), |(is_in, going), (w, mask)| {
            (
                is_in || self.grains(0, w).load(Ordering::Acquire) & mask != 0,
                going || self.grains(1, w).load(Ordering::Acquire) & mask != 0,
            )
        })
    }

    /// Marks the grains of `[first, end)` that are neither in the copy nor under way as
    /// under way, for a GET of this process: the ones it took, or `None`.
    pub fn take_grains(&self, first: u64, end: u64) -> Option<Grains> {
        self.take_grains_for(std::process::id(), first, end)
    }

    fn take_grains_for(&self, pid: u32, first: u64, end: u64) -> Option<Grains> {
        let place = self.note_taker(pid);
        let mut taken = Grains {
            words: Vec::new(),
            first: u64::MAX,
            end: 0,
        };
        for (w, mask) in Self::grain_words(first, end) {
            let here = self.grains(0, w).load(Ordering::Acquire);
            let want = mask & !here;
            if want == 0 {
                continue;
            }
            let mine = want & !self.grains(1, w).fetch_or(want, Ordering::AcqRel);
            if mine != 0 {
                // Named after the bits are taken: one who lets go of a dead process's
                // grains in between may let go of these too (fetched twice, the same
                // bytes), never keep a dead one's.
                for b in 0..OWNER_BITS {
                    let map = self.grains(2 + b, w);
                    if place >> b & 1 == 1 {
                        map.fetch_or(mine, Ordering::AcqRel);
                    } else {
                        map.fetch_and(!mine, Ordering::AcqRel);
                    }
                }
                let base = w as u64 * 64;
                taken.first = taken.first.min(base + u64::from(mine.trailing_zeros()));
                taken.end = taken.end.max(base + 64 - u64::from(mine.leading_zeros()));
                taken.words.push((w, mine));
            }
        }
        (!taken.words.is_empty()).then_some(taken)
    }

    /// The grains `taken` are in the copy (`landed`), or their GET failed and they are
    /// free again; either way no longer under way.
    pub fn put_grains(&self, taken: &Grains, landed: bool) {
        for &(w, mine) in &taken.words {
            if landed {
                let was = self.grains(0, w).fetch_or(mine, Ordering::AcqRel);
                self.count_landed(mine & !was);
            }
            self.grains(1, w).fetch_and(!mine, Ordering::AcqRel);
        }
        self.wake();
    }

    /// Names process `pid` among the grains' takers, once: its place, or [`UNNAMED`]
    /// while every place is held by a live process.
    fn note_taker(&self, pid: u32) -> usize {
        let takers = &self.head().takers;
        if let Some(i) = takers.iter().position(|t| t.load(Ordering::Acquire) == pid) {
            return i;
        }
        // A place free, or of a process that ended (its grains let go first).
        for (i, t) in takers.iter().enumerate() {
            if t.load(Ordering::Acquire) == 0
                && t.compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                return i;
            }
        }
        if self.free_grains_of_the_dead() {
            return self.note_taker(pid);
        }
        UNNAMED
    }

    /// When a process that took grains has ended (SIGKILL, the OOM killer) with GETs
    /// under way, their grains would stay under way for good and every read of them
    /// wait: the grains its place names are let go, a live taker's stay under way.
    /// True when one had ended.
    pub fn free_grains_of_the_dead(&self) -> bool {
        let mut dead = 0u64;
        for (i, t) in self.head().takers.iter().enumerate() {
            let held = t.load(Ordering::Acquire);
            if held != 0
                && held != FREEING
                && !alive(held)
                && t.compare_exchange(held, FREEING, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                dead |= 1 << i;
            }
        }
        if dead == 0 {
            return false;
        }
        for w in 0..Self::words(self.head().size) {
            let under_way = self.grains(1, w).load(Ordering::Acquire);
            if under_way == 0 {
                continue;
            }
            let owner: [u64; OWNER_BITS] =
                std::array::from_fn(|b| self.grains(2 + b, w).load(Ordering::Acquire));
            let mut freed = 0;
            for place in (0..TAKERS).filter(|i| dead >> i & 1 == 1) {
                let of = (0..OWNER_BITS).fold(under_way, |m, b| {
                    m & if place >> b & 1 == 1 {
                        owner[b]
                    } else {
                        !owner[b]
                    }
                });
                freed |= of;
            }
            if freed != 0 {
                self.grains(1, w).fetch_and(!freed, Ordering::AcqRel);
            }
        }
        // Before the places are free: a new taker there gave no order.
        self.head().ordered.fetch_and(!dead, Ordering::AcqRel);
        for (i, t) in self.head().takers.iter().enumerate() {
            if dead >> i & 1 == 1 {
                t.store(0, Ordering::Release);
            }
        }
        self.wake();
        true
    }

    /// Marks `[first, end)` in the copy: bytes a GET of another kind put there.
    pub fn grains_landed(&self, first: u64, end: u64) {
        for (w, mask) in Self::grain_words(first, end) {
            let was = self.grains(0, w).fetch_or(mask, Ordering::AcqRel);
            self.count_landed(mask & !was);
        }
    }

    fn count_landed(&self, new: u64) {
        let bytes = u64::from(new.count_ones()) * GRAIN;
        self.head().landed.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Bytes of grains in the copy (its last grain counted whole).
    pub fn landed(&self) -> u64 {
        self.head().landed.load(Ordering::Relaxed)
    }

    /// Takes a place among the copiers for process `pid`; false when all are taken by
    /// live processes (a place of one that ended is freed here).
    pub fn enter(&self, pid: u32) -> bool {
        for c in &self.head().copiers {
            let held = c.load(Ordering::Acquire);
            if (held == 0 || !alive(held))
                && c.compare_exchange(held, pid, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                return true;
            }
        }
        false
    }

    /// Gives back a place [`Board::enter`] took.
    pub fn leave(&self, pid: u32) {
        for c in &self.head().copiers {
            if c.compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return;
            }
        }
    }

    /// Frees piece `p` if the process holding it has ended; true when it did.
    pub fn free_if_orphaned(&self, p: u64) -> bool {
        let piece = self.piece(p);
        match piece.owner() {
            Some(pid) if !alive(pid) && self.swap(p, piece, Piece::Free) => {
                self.filled(p).store(0, Ordering::Release);
                self.next().fetch_min(p, Ordering::AcqRel);
                self.wake();
                true
            }
            _ => false,
        }
    }

    pub fn fail(&self) {
        self.head().failed.store(1, Ordering::Release);
        self.wake();
    }

    /// The arrival count, to wait on.
    pub fn arrivals(&self) -> u32 {
        self.head().arrivals.load(Ordering::Acquire)
    }

    /// Wakes every reader waiting in any process.
    pub fn wake(&self) {
        let word = &self.head().arrivals;
        word.fetch_add(1, Ordering::AcqRel);
        // SAFETY: a futex on a u32 of a shared mapping (no PRIVATE flag: other processes).
        unsafe {
            libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
        }
    }

    /// Waits until the arrival count is no longer `seen`, or `timeout` passed.
    pub fn wait(&self, seen: u32, timeout: Duration) {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as _,
            tv_nsec: timeout.subsec_nanos() as _,
        };
        // SAFETY: as in `wake`; the kernel reads `ts` during the call.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.head().arrivals.as_ptr(),
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
            );
        }
    }
}

/// Whether process `pid` is running (a zombie not yet reaped is not: its GETs ended).
pub fn alive(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid as i32, 0) };
    (rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
        && crate::node::running(pid)
}

impl Drop for Board {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new board of a copy of `size` bytes in `pieces`, and a second mapping of it (as
    /// another process has).
    fn two_mappings(size: u64, pieces: u64) -> (Board, Board) {
        let file = crate::source::scratch::memfd().unwrap();
        file.set_len(Board::file_len(size, pieces)).unwrap();
        let a = Board::create(file, size, pieces, 7).unwrap();
        let b = Board::open(a.file().try_clone().unwrap(), size).unwrap();
        (a, b)
    }

    #[test]
    fn grains_are_taken_once_and_seen_by_every_mapping() {
        let size = 1 << 20; // 256 grains, 4 bitmap words
        let (a, b) = two_mappings(size, 1);
        assert!(!a.ordered());
        b.set_ordered();
        assert!(a.ordered());
        // Grains 60..70 cross a word; another mapping cannot take them again.
        let t = a.take_grains(60, 70).unwrap();
        assert_eq!((t.first, t.end), (60, 70));
        assert!(b.take_grains(60, 70).is_none());
        // Its neighbours are free: only they are taken.
        let u = b.take_grains(50, 80).unwrap();
        assert_eq!((u.first, u.end), (50, 80));
        assert!(!b.grains_in(50, 80));
        a.put_grains(&t, true);
        assert!(b.grains_in(60, 70) && !b.grains_in(59, 70));
        assert_eq!(b.landed(), 10 * GRAIN);
        // A failed GET frees its grains for the next taker.
        b.put_grains(&u, false);
        assert!(!a.grains_in(50, 60));
        // Taken around grains already there: two runs, or one across a short gap.
        let w = b.take_grains(40, 120).unwrap();
        assert_eq!(w.runs(4), vec![(40, 60), (70, 120)]);
        assert_eq!(w.runs(10), vec![(40, 120)]);
        b.put_grains(&w, false);
        let v = a.take_grains(0, 256).unwrap();
        assert_eq!((v.first, v.end), (0, 256));
        a.put_grains(&v, true);
        assert!(b.grains_in(0, 256));
        assert!(b.take_grains(0, 256).is_none());
        // Each grain counted once, however it came.
        b.grains_landed(0, 256);
        assert_eq!(a.landed(), size);
    }

    #[test]
    fn a_dead_takers_grains_are_let_go_and_no_one_elses() {
        let (a, b) = two_mappings(1 << 20, 1);
        let me = std::process::id();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        // Interleaved in one bitmap word and across words: the live taker's, the dead
        // one's, another live one's (a place of its own).
        let mine = a.take_grains_for(me, 10, 20).unwrap();
        let theirs = b.take_grains_for(dead, 0, 100).unwrap();
        assert_eq!(theirs.runs(0), vec![(0, 10), (20, 100)]);
        let other = a.take_grains_for(1, 100, 130).unwrap();
        assert!(a.free_grains_of_the_dead());
        assert!(!a.free_grains_of_the_dead(), "let go twice");
        // The dead one's are free to take again; the others' are still under way.
        let again = b.take_grains_for(me, 0, 130).unwrap();
        assert_eq!(again.runs(0), vec![(0, 10), (20, 100)]);
        a.put_grains(&mine, true);
        a.put_grains(&other, true);
        a.put_grains(&again, true);
        assert!(b.grains_in(0, 130) && !b.grains_in(0, 131));
        // Its place is free again.
        let places = &a.head().takers;
        assert!(places.iter().all(|t| t.load(Ordering::Acquire) != dead));
        assert!(places.iter().any(|t| t.load(Ordering::Acquire) == me));
    }

    #[test]
    fn an_order_is_forgotten_once_its_process_ended() {
        let (a, b) = two_mappings(1 << 20, 1);
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        b.set_ordered_for(dead);
        assert!(
            !a.ordered(),
            "its process ended: a mapping looks at its first ask"
        );
        assert!(!b.ordered());
        // A live order stays; the place of the dead one is free for another.
        a.set_ordered();
        assert!(b.ordered());
        std::thread::sleep(LOOK_ORDERS + Duration::from_millis(10));
        assert!(b.ordered());
        let places = &a.head().takers;
        assert!(places.iter().all(|t| t.load(Ordering::Acquire) != dead));
    }

    #[test]
    fn pieces_encode_and_a_second_mapping_sees_the_first() {
        for p in [
            Piece::Free,
            Piece::Taken(7),
            Piece::Arriving(4_194_304),
            Piece::Copied,
        ] {
            assert_eq!(Piece::decode(p.encode()), p);
        }
        let (a, b) = two_mappings(10 << 20, 3);
        assert!(Board::open(a.file().try_clone().unwrap(), 11 << 20).is_err());
        assert!(a.swap(1, Piece::Free, Piece::Taken(5)));
        assert_eq!(b.piece(1), Piece::Taken(5));
        assert!(!b.swap(1, Piece::Free, Piece::Taken(6)));
        b.filled(2).store(99, Ordering::Release);
        assert_eq!(a.filled(2).load(Ordering::Acquire), 99);
        assert_eq!(a.piece(2), Piece::Free);
        let seen = a.arrivals();
        b.wake();
        a.wait(seen, Duration::from_secs(5)); // returns at once: the count moved
        assert_eq!(a.left().load(Ordering::Acquire), 3);
        // A place among the copiers, and a piece, held by a process that ended are free.
        let me = std::process::id();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        assert!((0..COPIERS).all(|_| a.enter(dead)));
        assert!(b.enter(me), "a dead process's place was kept");
        b.leave(me);
        assert!(a.swap(0, Piece::Free, Piece::Arriving(dead)));
        assert!(a.swap(1, Piece::Taken(5), Piece::Taken(me)));
        assert!(!a.free_if_orphaned(1), "a live process's piece was freed");
        assert!(b.free_if_orphaned(0));
        assert_eq!(a.piece(0), Piece::Free);
    }
}
