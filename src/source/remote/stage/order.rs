//! The node's copy filled in the order the job will read its files: a DataLoader's
//! sampler draws each epoch's order in advance, so the reader is handed the files to
//! come ([`fetch_ahead`]) and fetches them while the workers decode, many GETs in
//! flight, neighbours in one GET, each byte into the node's copy once. The first batches'
//! files come one GET each; past them, where the order holds most of the object (an
//! epoch on one node), the [`BLOCK`]s around the files, in the order's order, keep the
//! link full at few GETs. Without an order a shuffled epoch reads one file a round trip
//! a worker (8 workers at 20 ms: 400 files a second), and the copy of whole pieces brings
//! a batch's files only once it has most of the object (a batch of 256 files lies in
//! ~256 different pieces).
//!
//! Every process of the node reads what the order brought: its grains are marked on the
//! copy's board, and a read of bytes under way waits for them, one the order has not
//! reached fetches them ([`StagedCopy::fill_for`]). A DataLoader worker rather takes its
//! batch's files as they land ([`crate::archive::landed`]), while the copy will be whole
//! soon. A new order replaces this process's last one (the next epoch's is handed over
//! behind the current one's, so the link is not idle between epochs).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::board::GRAIN;
use super::StagedCopy;
use crate::per_process::PerProcess;
use crate::sync::{Condvar, Mutex};

/// GETs of files of the order under way at once in this process: at 50 ms and 1 Gbit/s
/// a link holds ~6 MB in flight, ~55 files of ImageNet's 110 KiB. Within the HTTP client's
/// limit (64), so reads of what the order has not reached still get through.
const IN_FLIGHT: usize = 48;
/// Files of the order after the next one looked over for neighbours in the archive to
/// fetch in the same GET.
const LOOK: usize = 64;
/// Bytes between two files fetched with them rather than in a GET of their own: a tar
/// member's header and padding, a SquashFS file's neighbour's tail.
const GAP: u64 = 16 << 10;
/// Bytes one GET of the order takes at most: a file of its own is fetched whole, however
/// large.
const MOST: u64 = 4 << 20;
/// Where the order holds most of a copy's bytes (an epoch on one node), past its first
/// bytes the copy is fetched in the blocks around its files, in the order's order: those
/// bytes are read later in the epoch anyway, and a GET a file costs the server, the
/// link and this node more than the bytes do. On the bench's 10 ms link and 2 cores,
/// 10,000 files of ~110 KiB one GET each came at 43 MB/s, a stream of the object at
/// 113 MB/s; blocks of 1 MiB 48 at once at 90-105 MB/s, of 4 MiB 16 at once and of
/// 8 MiB 8 at once at 115-120 (each GET and each TCP flow costs CPU in the server, the
/// relay and here). Two pieces of the copy; a part of the usual multipart upload.
const BLOCK: u64 = 8 << 20;
/// GETs of [`BLOCK`]s under way at once: 48 MiB in flight, a 10 Gbit/s link at 40 ms.
/// Each flow sends in segments of about a millisecond of its own rate (the kernel's TSO
/// sizing), so flows sharing a link cost packets, and every packet costs CPU in the
/// server, the network and here: 12 blocks and the workers' own GETs sent 135,000
/// packets for the bench's 1.1 GB, WebDataset's 4 streams 50,000. With decoding, CPU is
/// what the epoch waits for: 6 took it from 30.8 s to 24.8-26.6 s (WebDataset 22-28 s).
/// At 50 ms a flow is short of its window: 12 kept that link at 108-120 MB/s (10.7 s
/// without decoding), 6 at ~115 once past the first files (11.8 s, WebDataset 10.7).
/// (docs/history/2026-11-27-to-28-object-storage-nodes-ranks.md#fewer-flows-a-batch-decoded-as-its-files-land-issue-53-2026-11-29-thirty-third-session).
const BLOCKS_IN_FLIGHT: usize = 6;
/// The order's first bytes, fetched file by file before any block: the first batches,
/// at once. An eighth of a smaller order.
const FILES_FIRST: u64 = 32 << 20;
/// Files fetched one GET each before blocks at most: two batches of 256. ImageNet's
/// count of 1-400 B files holds 32 MiB in its first 160,000 files, and 20,000 such
/// files one GET each took 20 s where the stream of their tar took 0.4.
const FIRST_FILES: usize = 512;
/// A file among the first of a copy fetched in [`BLOCK`]s comes with the bytes around it
/// up to this many: later in the epoch they are read anyway, a GET of 110 KiB costs
/// the server, the relay and this node as much CPU as one of 256 KiB, and its block is
/// then fetched in fewer GETs (around it). A file smaller than what a block's GET
/// fetches across anyway ([`super::JOINED`] grains) comes alone: ImageNet's count of
/// 1-400 B files rounded up took 64 MB for its first batch.
const FIRST_GET: u64 = 256 << 10;
/// The share of a copy's bytes an order must hold for [`BLOCK`]s, with the gaps of less
/// than [`GAP`] between its files (a tar member's header and padding: 1-400 B files are
/// a fifth of their tar).
const MOSTLY: f64 = 0.5;
/// A run that did not land whole (bytes under way for another process, which may end
/// before they land; a GET that failed) is taken again this long after, once. A rank
/// killed mid-epoch left its GETs' bytes under way, which the other rank's order had
/// passed: each of its batches that wanted them waited a second in vain, 22 s from the
/// kill to the epoch's end for 64 MiB at 16 MiB/s; 7-9 s taken again.
const AGAIN: Duration = Duration::from_millis(500);

/// Bytes this process fetched into node copies filled in order (the order's GETs and
/// reads of bytes it had not reached).
pub(super) static FETCHED: AtomicU64 = AtomicU64::new(0);

/// Bytes this process fetched into node copies filled in order.
pub fn fetched_ahead() -> u64 {
    FETCHED.load(Ordering::Relaxed)
}

/// A node's copy to fill in order: got from [`crate::source::Storage::fill`].
#[derive(Clone, Debug)]
pub struct Fill(pub(in crate::source::remote) Arc<StagedCopy>);

/// What an order asks of a copy it fills: which it is, its size, and whether bytes are
/// in it already. The plan ([`Order`]) sees nothing else, so it is tested without a store.
trait Target: Clone {
    fn same(&self, other: &Self) -> bool;
    fn size(&self) -> u64;
    fn has(&self, at: u64, len: u64) -> bool;
}

impl Target for Fill {
    fn same(&self, other: &Fill) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    fn size(&self) -> u64 {
        self.0.object.size
    }

    fn has(&self, at: u64, len: u64) -> bool {
        self.0.has(at, len)
    }
}

/// This process's order: the copies, and the spans to fetch into them, in order.
struct Order<F = Fill> {
    fills: Vec<F>,
    /// Whether each copy is fetched in [`BLOCK`]s as well.
    blocks: Vec<bool>,
    /// (copy, where, bytes); bytes 0 once fetched with a neighbour.
    spans: Vec<(u32, u64, u64)>,
    /// The next span fetched file by file.
    next: usize,
    /// Where blocks start (past the first [`FILES_FIRST`] bytes), and the next span
    /// whose block is fetched.
    first_blocks: usize,
    next_block: usize,
    /// GETs under way (of this order or the one it replaced): files, blocks.
    files_out: usize,
    blocks_out: usize,
    /// Runs to take again ([`AGAIN`]), with when.
    again: VecDeque<(Run<F>, Instant)>,
}

impl<F> Default for Order<F> {
    fn default() -> Self {
        Order {
            fills: Vec::new(),
            blocks: Vec::new(),
            spans: Vec::new(),
            next: 0,
            first_blocks: 0,
            next_block: 0,
            files_out: 0,
            blocks_out: 0,
            again: VecDeque::new(),
        }
    }
}

/// What the order took: the copy, where it starts and ends, whether it is a block, and
/// whether it is taken again ([`AGAIN`]).
#[derive(Debug)]
struct Run<F = Fill> {
    fill: F,
    from: u64,
    to: u64,
    block: bool,
    again: bool,
}

impl<F: Clone> Run<F> {
    fn new(fill: &F, from: u64, to: u64, block: bool) -> Run<F> {
        let fill = fill.clone();
        Run {
            fill,
            from,
            to,
            block,
            again: false,
        }
    }
}

struct Queue {
    order: Mutex<Order>,
    more: Condvar,
}

fn queue() -> &'static Queue {
    static QUEUE: PerProcess<Queue> = PerProcess::new();
    let (q, made) = QUEUE.get_or_make(|| Queue {
        order: Mutex::new(Order::default()),
        more: Condvar::new(),
    });
    if made {
        for i in 0..IN_FLIGHT {
            let _ = std::thread::Builder::new()
                .name(format!("archfs-order-{i}"))
                .spawn(move || q.work());
        }
    }
    q
}

/// Fetches `spans` (each a copy of [`Fill`]s, where and how many bytes) into the node's
/// copies in this order, in the background, in place of this process's last order.
pub fn fetch_ahead(spans: Vec<(Fill, u64, u64)>) {
    let order = Order::new(spans);
    let q = queue();
    q.order.lock().replace(order);
    q.more.notify_all();
}

impl Queue {
    fn work(&self) {
        loop {
            let run = {
                let mut order = self.order.lock();
                loop {
                    if let Some(run) = order.take() {
                        break run;
                    }
                    order = match order.again.front() {
                        Some((_, when)) => {
                            let until = when.saturating_duration_since(Instant::now());
                            self.more.wait_timeout(order, until)
                        }
                        None => self.more.wait(order),
                    };
                }
            };
            let (first, end) = (run.from / GRAIN, run.to.div_ceil(GRAIN));
            let board = &run.fill.0.board;
            // Bytes still under way long after: their taker may have ended.
            if run.again && !board.grains_in(first, end) {
                board.free_grains_of_the_dead();
            }
            if let Some(taken) = board.take_grains(first, end) {
                run.fill.0.fill(&taken);
            }
            let whole = board.grains_in(first, end);
            let mut order = self.order.lock();
            if run.block {
                order.blocks_out -= 1;
            } else {
                order.files_out -= 1;
            }
            if !whole && !run.again {
                order.again_later(run);
            }
            drop(order);
            self.more.notify_all();
        }
    }
}

impl<F: Target> Order<F> {
    /// The plan for `spans` in this order: which copies are fetched in blocks, and where
    /// the blocks start.
    fn new(spans: Vec<(F, u64, u64)>) -> Order<F> {
        let mut order: Order<F> = Order::default();
        for (fill, at, len) in spans {
            let i = match order.fills.iter().position(|f| f.same(&fill)) {
                Some(i) => i,
                None => {
                    order.fills.push(fill);
                    order.fills.len() - 1
                }
            };
            if len > 0 {
                order.spans.push((i as u32, at, len));
            }
        }
        // What the order holds of each copy, each byte once (it may hold two epochs), with
        // the gaps under GAP between its files, as a GET of neighbours would fetch them.
        let mut held = vec![0u64; order.fills.len()];
        let mut sorted = order.spans.clone();
        sorted.sort_unstable();
        let mut end = (u32::MAX, 0);
        for (f, at, len) in sorted {
            let bridged = at.saturating_sub(GAP) < end.1;
            let from = if end.0 == f && bridged { end.1 } else { at };
            held[f as usize] += (at + len).saturating_sub(from);
            if end.0 != f || at + len > end.1 {
                end = (f, at + len);
            }
        }
        order.blocks = (order.fills.iter().zip(held))
            .map(|(f, n)| n as f64 >= MOSTLY * f.size() as f64)
            .collect();
        order.next_block = order.spans.len();
        if order.blocks.contains(&true) {
            let total: u64 = order.spans.iter().map(|s| s.2).sum();
            let firsts = FILES_FIRST.min(total / 8);
            let mut bytes = 0;
            order.next_block = (order.spans.iter())
                .position(|&(_, _, len)| {
                    bytes += len;
                    bytes > firsts
                })
                .unwrap_or(order.spans.len())
                .min(FIRST_FILES);
        }
        order.first_blocks = order.next_block;
        order
    }

    /// The next GET to make: the first spans file by file, then blocks (at most
    /// [`BLOCKS_IN_FLIGHT`]), and files of copies not fetched in blocks.
    fn take(&mut self) -> Option<Run<F>> {
        self.take_at(Instant::now())
    }

    /// [`take`](Self::take) at `now`. A run taken again counts among the GETs of its
    /// kind, as its end is counted off there.
    fn take_at(&mut self, now: Instant) -> Option<Run<F>> {
        if let Some(run) = self.take_again(now) {
            if run.block {
                self.blocks_out += 1;
            } else {
                self.files_out += 1;
            }
            return Some(run);
        }
        if let Some(run) = self.take_block_if_due() {
            return Some(run);
        }
        if self.files_out >= IN_FLIGHT {
            return None;
        }
        if let Some(run) = self.take_file() {
            self.files_out += 1;
            return Some(run);
        }
        // The first files were in already: the blocks are due now.
        self.take_block_if_due()
    }

    /// A block, once past the first files and with fewer than [`BLOCKS_IN_FLIGHT`] out.
    fn take_block_if_due(&mut self) -> Option<Run<F>> {
        if self.next < self.first_blocks || self.blocks_out >= BLOCKS_IN_FLIGHT {
            return None;
        }
        let run = self.take_block()?;
        self.blocks_out += 1;
        Some(run)
    }

    /// `next` in place of this order, with the GETs under way and the runs to take again.
    fn replace(&mut self, mut next: Order<F>) {
        (next.files_out, next.blocks_out) = (self.files_out, self.blocks_out);
        next.again = std::mem::take(&mut self.again);
        *self = next;
    }

    /// A run that did not land whole, taken again after [`AGAIN`] unless it is there by
    /// then.
    fn again_later(&mut self, mut run: Run<F>) {
        run.again = true;
        self.again.push_back((run, Instant::now() + AGAIN));
    }

    /// The first run due to be taken again by `now` and not in its copy by then.
    fn take_again(&mut self, now: Instant) -> Option<Run<F>> {
        while let Some((run, when)) = self.again.front() {
            if run.fill.has(run.from, run.to - run.from) {
                self.again.pop_front();
                continue;
            }
            if *when > now {
                return None;
            }
            return self.again.pop_front().map(|(run, _)| run);
        }
        None
    }

    /// The block around the next span of a copy fetched in blocks that is not in it yet.
    fn take_block(&mut self) -> Option<Run<F>> {
        while self.next_block < self.spans.len() {
            let (f, at, len) = self.spans[self.next_block];
            self.next_block += 1;
            let fill = &self.fills[f as usize];
            if len == 0 || !self.blocks[f as usize] || fill.has(at, len) {
                continue;
            }
            let from = at - at % BLOCK;
            let to = ((at + len).div_ceil(BLOCK).saturating_mul(BLOCK)).min(fill.size());
            return Some(Run::new(fill, from, to, true));
        }
        None
    }

    /// The next span not yet in its copy and not past the first spans of a copy fetched
    /// in blocks, with its neighbours among the next [`LOOK`] spans of the same copy.
    fn take_file(&mut self) -> Option<Run<F>> {
        while self.next < self.spans.len() {
            let (f, at, len) = self.spans[self.next];
            self.next += 1;
            let fill = &self.fills[f as usize];
            let blocked = self.blocks[f as usize] && self.next > self.first_blocks;
            if len == 0 || blocked || fill.has(at, len) {
                continue;
            }
            let (mut from, mut to) = (at, at + len);
            let look = self.next..(self.next + LOOK).min(self.spans.len());
            let mut grew = true;
            while grew {
                grew = false;
                for j in look.clone() {
                    let (g, a, l) = self.spans[j];
                    let near = a < to + GAP && a + l + GAP > from;
                    if g == f && l > 0 && near && to.max(a + l) - from.min(a) <= MOST {
                        (from, to) = (from.min(a), to.max(a + l));
                        self.spans[j].2 = 0;
                        grew = true;
                    }
                }
            }
            let alone = to - from <= super::JOINED * GRAIN;
            if self.blocks[f as usize] && to - from < FIRST_GET && !alone {
                from -= from % FIRST_GET;
                to = to.max(from + FIRST_GET).min(fill.size());
            }
            return Some(Run::new(fill, from, to, false));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use super::*;

    const FILE: u64 = 110 << 10;
    const HEADER: u64 = 512;

    /// A copy as the plan sees it: its size and the grains in it. A run is marked in as
    /// it is taken or when the test says it landed.
    #[derive(Clone)]
    struct Grains(Rc<(u64, RefCell<Vec<bool>>)>);

    impl std::fmt::Debug for Grains {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a copy of {} bytes", self.0 .0)
        }
    }

    impl Grains {
        fn new(size: u64) -> Grains {
            Grains(Rc::new((
                size,
                RefCell::new(vec![false; size.div_ceil(GRAIN) as usize]),
            )))
        }

        fn land(&self, from: u64, to: u64) {
            let mut grains = self.0 .1.borrow_mut();
            for g in from / GRAIN..to.div_ceil(GRAIN) {
                grains[g as usize] = true;
            }
        }
    }

    impl Target for Grains {
        fn same(&self, other: &Grains) -> bool {
            Rc::ptr_eq(&self.0, &other.0)
        }

        fn size(&self) -> u64 {
            self.0 .0
        }

        fn has(&self, at: u64, len: u64) -> bool {
            let grains = self.0 .1.borrow();
            (at / GRAIN..(at + len).div_ceil(GRAIN)).all(|g| grains[g as usize])
        }
    }

    /// `n` files of [`FILE`] bytes, each after a tar header: (copy, where each starts).
    fn archive(n: u64) -> (Grains, Vec<u64>) {
        let at = (0..n).map(|i| i * (HEADER + FILE) + HEADER).collect();
        (Grains::new(n * (HEADER + FILE)), at)
    }

    /// The plan for an epoch of all `n` files of [`archive`]`(n)`, shuffled.
    fn shuffled_epoch(n: u64) -> Order<Grains> {
        let (copy, at) = archive(n);
        let spans = shuffled(n)
            .into_iter()
            .map(|i| (copy.clone(), at[i as usize], FILE));
        Order::new(spans.collect())
    }

    /// A shuffle of `0..n` (an LCG's, as a sampler's would be).
    fn shuffled(n: u64) -> Vec<u64> {
        let mut v: Vec<u64> = (0..n).collect();
        let mut x = 12345u64;
        for i in (1..v.len()).rev() {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            v.swap(i, (x >> 33) as usize % (i + 1));
        }
        v
    }

    /// Takes every run the plan makes, each landing before the next is taken.
    fn drain(order: &mut Order<Grains>) -> Vec<Run<Grains>> {
        let mut runs = Vec::new();
        while let Some(run) = order.take() {
            run.fill.land(run.from, run.to);
            if run.block {
                order.blocks_out -= 1;
            } else {
                order.files_out -= 1;
            }
            runs.push(run);
        }
        runs
    }

    #[test]
    fn an_epoch_comes_file_by_file_first_then_in_blocks_in_the_order_s_order() {
        let (copy, at) = archive(1000);
        let order_of = shuffled(1000);
        let spans = order_of
            .iter()
            .map(|&i| (copy.clone(), at[i as usize], FILE));
        let mut order = Order::new(spans.collect());
        assert_eq!(order.blocks, vec![true]);
        // The first eighth of the order's bytes (under FILES_FIRST here) file by file.
        let firsts = (1000 * FILE / 8).div_ceil(FILE) as usize;
        assert_eq!(order.first_blocks, firsts);
        let runs = drain(&mut order);

        let files = runs.iter().take_while(|r| !r.block).count();
        assert!(files > 0 && files <= firsts, "{files} GETs of files");
        assert!(
            runs[files..].iter().all(|r| r.block),
            "files after the blocks began"
        );
        for r in &runs[..files] {
            // Each with the bytes around it up to FIRST_GET (from a boundary of it), or
            // with neighbours as many.
            assert!(r.to - r.from >= FIRST_GET || r.to == copy.size(), "{r:?}");
            assert!(
                r.from % FIRST_GET == 0 || r.to - r.from > FIRST_GET,
                "{r:?}"
            );
        }
        // Blocks on their boundaries, in the order their files first come, none again
        // once its files are in (a file across two blocks brings both).
        let mut expect = Vec::new();
        let probe = Grains::new(copy.size());
        for r in &runs[..files] {
            probe.land(r.from, r.to);
        }
        for &i in &order_of[firsts..] {
            let (a, b) = (at[i as usize], at[i as usize] + FILE);
            if !probe.has(a, FILE) {
                expect.push(a - a % BLOCK);
                probe.land(a - a % BLOCK, (b.div_ceil(BLOCK) * BLOCK).min(copy.size()));
            }
        }
        let blocks: Vec<u64> = runs[files..].iter().map(|r| r.from).collect();
        assert_eq!(blocks, expect);
        assert!(runs[files..].iter().all(|r| r.to - r.from <= 2 * BLOCK));
        assert!(blocks.len() as u64 <= copy.size().div_ceil(BLOCK));
        // And every file of the order is in the copy.
        assert!(at.iter().all(|&a| copy.has(a, FILE)));
    }

    #[test]
    fn an_epoch_of_tiny_files_comes_in_blocks_after_two_batches_of_them() {
        // ImageNet's shape at 1-400 B: each file a 512 B header and a 512 B record, so
        // the files are a fifth of the tar.
        let (n, tiny, stride) = (20_000u64, 200, 2 * HEADER);
        let copy = Grains::new(n * stride);
        let spans = shuffled(n)
            .into_iter()
            .map(|i| (copy.clone(), i * stride + HEADER, tiny));
        let mut order = Order::new(spans.collect());
        assert_eq!(order.blocks, vec![true]);
        assert_eq!(order.first_blocks, FIRST_FILES);
        let runs = drain(&mut order);
        let files = runs.iter().filter(|r| !r.block).count();
        assert!(files <= FIRST_FILES, "{files} GETs of files");
        assert!(runs.len() <= FIRST_FILES + copy.size().div_ceil(BLOCK) as usize);
        // Each of them alone, or with neighbours within GAP: not rounded up to FIRST_GET.
        let most = runs
            .iter()
            .filter(|r| !r.block)
            .map(|r| r.to - r.from)
            .max();
        assert!(
            most.unwrap() <= 4 * GAP,
            "a GET of {most:?} bytes for tiny files"
        );
        assert!(
            runs.iter().any(|r| r.block),
            "no blocks: {} GETs",
            runs.len()
        );
        assert!((0..n).all(|i| copy.has(i * stride + HEADER, tiny)));
        // A third of them, each two apart (a gap of 2 KiB): still the blocks.
        let third = (0..n)
            .step_by(3)
            .map(|i| (copy.clone(), i * stride + HEADER, tiny));
        assert_eq!(Order::new(third.collect()).blocks, vec![true]);
    }

    #[test]
    fn a_run_that_did_not_land_is_taken_again_once_later_unless_it_landed() {
        let (copy, at) = archive(4);
        let mut order = Order::new(vec![
            (copy.clone(), at[0], FILE),
            (copy.clone(), at[2], FILE),
        ]);
        order.blocks = vec![false];
        let (a, b) = (order.take_file().unwrap(), order.take_file().unwrap());
        let now = Instant::now();
        order.again_later(a);
        order.again_later(b);
        assert!(order.take_again(now).is_none(), "taken again at once");
        // The second landed meanwhile (a GET of another process's): only the first.
        copy.land(at[2], at[2] + FILE);
        let later = now + AGAIN + Duration::from_millis(1);
        let run = order.take_again(later).expect("the run that did not land");
        assert!(run.again && run.from <= at[0] && run.to >= at[0] + FILE);
        assert!(order.take_again(later).is_none());
        // A new order takes over what is to be taken again, and the GETs under way.
        order.again_later(run);
        order.files_out = 2;
        order.replace(Order::new(vec![(copy.clone(), at[3], FILE)]));
        assert_eq!((order.again.len(), order.files_out), (1, 2));
        assert_eq!(order.spans.len(), 1);
    }

    #[test]
    fn a_block_taken_again_counts_among_the_blocks_under_way() {
        let mut order = shuffled_epoch(1000);
        order.first_blocks = 0;
        let block = order.take().expect("a block");
        assert!(block.block);
        // Its GET ended without its bytes (another process had them under way).
        order.blocks_out -= 1;
        order.again_later(block);
        let later = Instant::now() + AGAIN + Duration::from_millis(1);
        let again = order.take_at(later).expect("the block again");
        assert!(again.block && again.again);
        assert_eq!((order.files_out, order.blocks_out), (0, 1));
    }

    #[test]
    fn at_most_so_many_gets_of_files_and_of_blocks_are_under_way() {
        let mut order = shuffled_epoch(2000);
        let mut taken = Vec::new();
        while let Some(run) = order.take() {
            taken.push(run);
        }
        assert_eq!(taken.len(), IN_FLIGHT);
        assert!(taken.iter().all(|r| !r.block));
        // The first files in: the rest of them, then blocks, at most so many at once.
        for r in taken.drain(..) {
            r.fill.land(r.from, r.to);
            order.files_out -= 1;
        }
        while order.next < order.first_blocks {
            let run = order.take().expect("a file of the first ones");
            assert!(!run.block);
            run.fill.land(run.from, run.to);
            order.files_out -= 1;
        }
        while let Some(run) = order.take() {
            taken.push(run);
        }
        assert_eq!(taken.len(), BLOCKS_IN_FLIGHT);
        assert!(taken.iter().all(|r| r.block));
        // One lands: one more is taken.
        order.blocks_out -= 1;
        assert!(order.take().is_some_and(|r| r.block));
        assert!(order.take().is_none());
    }

    #[test]
    fn a_share_of_the_copy_comes_file_by_file_with_its_neighbours_in_one_get() {
        let (copy, at) = archive(1000);
        // A node's share: a fifth of the files. Among them 10 and 11 next to each other,
        // 300..350 in a row (5.5 MB: two GETs), 20 in the copy already.
        copy.land(at[20], at[20] + FILE);
        let mut share: Vec<u64> = vec![10, 500, 11, 20, 13];
        share.extend(300..350);
        share.extend((600..1000).step_by(3));
        let spans = share.iter().map(|&i| (copy.clone(), at[i as usize], FILE));
        let mut order = Order::new(spans.collect());
        assert_eq!(order.blocks, vec![false]);
        let runs = drain(&mut order);
        assert!(runs.iter().all(|r| !r.block));
        let covers = |r: &Run<Grains>, i: usize| r.from <= at[i] && at[i] + FILE <= r.to;
        // 10 and 11 (a header apart) in one GET; 500 and 13 in GETs of their own; 20 in none.
        assert!(
            covers(&runs[0], 10)
                && covers(&runs[0], 11)
                && runs[0].to - runs[0].from < 2 * FILE + GAP
        );
        assert!(covers(&runs[1], 500) && runs[1].to - runs[1].from == FILE);
        assert!(covers(&runs[2], 13) && runs[2].to - runs[2].from == FILE);
        assert!(!runs.iter().any(|r| covers(r, 20)));
        // The row in GETs of at most MOST bytes, each of whole files.
        let row: Vec<_> = runs
            .iter()
            .filter(|r| (300..350).any(|i| covers(r, i)))
            .collect();
        assert_eq!(row.len(), (50 * (FILE + HEADER)).div_ceil(MOST) as usize);
        assert!(row.iter().all(|r| r.to - r.from <= MOST));
        // Every file of the share in the copy, and nothing else but the gaps between them.
        assert!(share.iter().all(|&i| copy.has(at[i as usize], FILE)));
        assert!(!copy.has(at[12], FILE) && !copy.has(at[601], FILE));
        assert!(runs.len() < share.len());
    }
}
