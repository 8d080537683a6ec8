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
//! reached fetches them ([`StagedCopy::fill_for`]). A new order replaces this process's last
//! one (the next epoch's is handed over behind the current one's, so the link is not
//! idle between epochs).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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
/// GETs of [`BLOCK`]s under way at once: 96 MiB in flight, a 10 Gbit/s link at 75 ms.
/// At 50 ms and 1 Gbit/s, 8 left the link at 77-96 MB/s late in the epoch, each flow
/// short of its window (W = 4 / 8: 11.4 / 12.1 s); 12 kept it at 108-120 (10.7 /
/// 11.2 s), and changed nothing at 10 ms.
const BLOCKS_IN_FLIGHT: usize = 12;
/// The order's first bytes, fetched file by file before any block: the first batches,
/// at once. An eighth of a smaller order.
const FILES_FIRST: u64 = 32 << 20;
/// A file among the first of a copy fetched in [`BLOCK`]s comes with the bytes around it
/// up to this many: later in the epoch they are read anyway, and a GET of 110 KiB costs
/// the server, the relay and this node as much CPU as one of 256 KiB.
const FIRST_GET: u64 = 256 << 10;
/// The share of a copy's bytes an order must hold for [`BLOCK`]s.
const MOSTLY: f64 = 0.5;

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

impl Fill {
    fn same(&self, other: &Fill) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// This process's order: the copies, and the spans to fetch into them, in order.
#[derive(Default)]
struct Order {
    fills: Vec<Fill>,
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
}

/// What the order took: the copy, where it starts and ends, whether it is a block.
struct Run {
    stage: Arc<StagedCopy>,
    from: u64,
    to: u64,
    block: bool,
}

impl Run {
    fn new(stage: &Arc<StagedCopy>, from: u64, to: u64, block: bool) -> Run {
        let stage = stage.clone();
        Run {
            stage,
            from,
            to,
            block,
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
    let mut order = Order::default();
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
    // What the order holds of each copy, each byte once (it may hold two epochs).
    let mut held = vec![0u64; order.fills.len()];
    let mut sorted = order.spans.clone();
    sorted.sort_unstable();
    let mut end = (u32::MAX, 0);
    for (f, at, len) in sorted {
        let from = if end.0 == f { at.max(end.1) } else { at };
        held[f as usize] += (at + len).saturating_sub(from);
        if end.0 != f || at + len > end.1 {
            end = (f, at + len);
        }
    }
    order.blocks = (order.fills.iter().zip(held))
        .map(|(f, n)| n as f64 >= MOSTLY * f.0.object.size as f64)
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
            .unwrap_or(order.spans.len());
    }
    order.first_blocks = order.next_block;
    let q = queue();
    let mut current = q.order.lock();
    (order.files_out, order.blocks_out) = (current.files_out, current.blocks_out);
    *current = order;
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
                    order = self.more.wait(order);
                }
            };
            let (first, end) = (run.from / GRAIN, run.to.div_ceil(GRAIN));
            if let Some(taken) = run.stage.board.take_grains(first, end) {
                run.stage.fill(&taken);
            }
            let mut order = self.order.lock();
            if run.block {
                order.blocks_out -= 1;
            } else {
                order.files_out -= 1;
            }
            drop(order);
            self.more.notify_all();
        }
    }
}

impl Order {
    /// The next GET to make: the first spans file by file, then blocks (at most
    /// [`BLOCKS_IN_FLIGHT`]), and files of copies not fetched in blocks.
    fn take(&mut self) -> Option<Run> {
        if self.next >= self.first_blocks && self.blocks_out < BLOCKS_IN_FLIGHT {
            if let Some(run) = self.take_block() {
                self.blocks_out += 1;
                return Some(run);
            }
        }
        if self.files_out >= IN_FLIGHT {
            return None;
        }
        let run = self.take_file()?;
        self.files_out += 1;
        Some(run)
    }

    /// The block around the next span of a copy fetched in blocks that is not in it yet.
    fn take_block(&mut self) -> Option<Run> {
        while self.next_block < self.spans.len() {
            let (f, at, len) = self.spans[self.next_block];
            self.next_block += 1;
            let stage = &self.fills[f as usize].0;
            if len == 0 || !self.blocks[f as usize] || stage.has(at, len) {
                continue;
            }
            let from = at - at % BLOCK;
            let to = ((at + len).div_ceil(BLOCK).saturating_mul(BLOCK)).min(stage.object.size);
            return Some(Run::new(stage, from, to, true));
        }
        None
    }

    /// The next span not yet in its copy and not past the first spans of a copy fetched
    /// in blocks, with its neighbours among the next [`LOOK`] spans of the same copy.
    fn take_file(&mut self) -> Option<Run> {
        while self.next < self.spans.len() {
            let (f, at, len) = self.spans[self.next];
            self.next += 1;
            let stage = &self.fills[f as usize].0;
            let blocked = self.blocks[f as usize] && self.next > self.first_blocks;
            if len == 0 || blocked || stage.has(at, len) {
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
            if self.blocks[f as usize] && to - from < FIRST_GET {
                from -= from % FIRST_GET;
                to = to.max(from + FIRST_GET).min(stage.object.size);
            }
            return Some(Run::new(stage, from, to, false));
        }
        None
    }
}
