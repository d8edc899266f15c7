//! Tensor parallelism across a node's worker processes (D111).
//!
//! A model served with `tensor_parallel_size = N` runs in N processes, one per TP rank. Each
//! holds a slice of the **output rows** of every weight matrix (its attention heads' Q/K/V rows,
//! `1/N` of the MLP's gate/up rows, `1/N` of the output projection's, the down projection's and
//! the vocabulary's rows) and the K/V of its own KV heads (a KV head is replicated on several
//! ranks when N exceeds the model's KV heads, as vLLM does). After each sliced matmul the ranks
//! **all-gather** their columns ([`Gather`]), so every rank goes on with the whole activation.
//!
//! Why gathers of output slices rather than Megatron's all-reduce of partial sums: every output
//! value is then computed by exactly the dot product a single process computes — the same
//! weights, the same whole input, the same kernel — so a TP group's logits equal a single
//! process's bit for bit and greedy output is identical by construction. Partial sums over
//! slices of the input would change the order of float additions (and a K-quant row cannot be
//! cut inside its 256-value superblocks: Qwen2.5-0.5B's `ffn_down` has 4864 inputs, 9.5
//! superblocks per half). The price is four gathers per layer instead of two reductions, each
//! a copy through shared memory on one host.
//!
//! [`ShmGroup`] is the gather between processes: one file in `/dev/shm` the TP rank 0 process
//! creates, each rank writing its slice into its own section, then publishing a round number;
//! a rank reads the others' sections once every rank has published the round. Two sections per
//! rank alternate, so one publication per round is the only synchronisation. A rank that waits
//! notices a peer process that died, a group another rank has poisoned (a failed step: the
//! group's state can no longer be trusted, and the node's worker restarts as a whole), and a
//! deadline, and then fails instead of hanging.

// Shared memory between processes: the mapping, its atomics and the copies in and out of it
// are `unsafe`, each with the protocol that makes it sound beside it.
#![allow(unsafe_code)]

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use crate::arch::ModelConfig;
use crate::error::ModelError;

/// The most TP ranks one group has (the header has a fixed slot per rank).
pub const MAX_TP_SIZE: usize = 16;

/// Which slice of the model one process computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpRank {
    pub rank: usize,
    pub size: usize,
}

impl TpRank {
    /// The one process of a model that is not split.
    pub const SINGLE: TpRank = TpRank { rank: 0, size: 1 };

    /// Whether `cfg` splits evenly over `size` ranks: query heads, hidden width, MLP width and
    /// vocabulary each a multiple of `size`, and KV heads either a multiple of it or a divisor
    /// (then each KV head is replicated on `size / kv_heads` ranks).
    pub fn check(&self, cfg: &ModelConfig) -> Result<(), ModelError> {
        let n = self.size;
        let bad = |what: &str, count: usize| {
            Err(ModelError::TensorParallel(format!(
                "{} has {count} {what}, not a multiple of tensor_parallel_size {n}",
                cfg.arch
            )))
        };
        if n == 0 || n > MAX_TP_SIZE || self.rank >= n {
            return Err(ModelError::TensorParallel(format!(
                "TP rank {} of {n}: tensor_parallel_size must be 1..={MAX_TP_SIZE}",
                self.rank
            )));
        }
        if !cfg.n_heads.is_multiple_of(n) {
            return bad("attention heads", cfg.n_heads);
        }
        if !cfg.n_kv_heads.is_multiple_of(n) && !n.is_multiple_of(cfg.n_kv_heads) {
            return Err(ModelError::TensorParallel(format!(
                "{} has {} KV heads: tensor_parallel_size {n} must be a multiple or a divisor of it",
                cfg.arch, cfg.n_kv_heads
            )));
        }
        if !cfg.hidden.is_multiple_of(n) {
            return bad("hidden units", cfg.hidden);
        }
        if !cfg.ffn_dim.is_multiple_of(n) {
            return bad("MLP units", cfg.ffn_dim);
        }
        if !cfg.vocab_size.is_multiple_of(n) {
            return bad("vocabulary entries", cfg.vocab_size);
        }
        Ok(())
    }

    /// This rank's share of `total` rows split evenly.
    pub fn share(&self, total: usize) -> std::ops::Range<usize> {
        let each = total / self.size;
        self.rank * each..(self.rank + 1) * each
    }

    /// The KV heads this rank holds, of `n_kv` (one replicated head when `size > n_kv`).
    pub fn kv_heads(&self, n_kv: usize) -> std::ops::Range<usize> {
        if n_kv >= self.size {
            self.share(n_kv)
        } else {
            let h = self.rank * n_kv / self.size;
            h..h + 1
        }
    }

    /// The hyper-parameters this rank's forward pass runs with: its own query and KV heads and
    /// MLP units; the hidden width and vocabulary stay whole (activations are gathered whole).
    pub fn local_config(&self, cfg: &ModelConfig) -> ModelConfig {
        let mut local = cfg.clone();
        local.n_heads = cfg.n_heads / self.size;
        local.n_kv_heads = self.kv_heads(cfg.n_kv_heads).len();
        local.ffn_dim = cfg.ffn_dim / self.size;
        local
    }
}

/// Why a gather failed. Any failure leaves the group unusable: the step fails and the worker
/// processes of the node restart together.
#[derive(Debug, thiserror::Error)]
pub enum TpError {
    #[error("TP group {path}: {why}")]
    Setup { path: String, why: String },
    #[error("TP rank {rank} (pid {pid}) is gone")]
    PeerGone { rank: usize, pid: u32 },
    #[error("the TP group was stopped by a rank whose step failed")]
    Poisoned,
    #[error("TP rank {rank} did not reach the gather within {waited:?}")]
    Timeout { rank: usize, waited: Duration },
    #[error("gather of {got} values over {rows} rows: not whole rows")]
    Shape { got: usize, rows: usize },
}

/// The collective a TP forward pass needs: every rank contributes `[rows, w]` values and
/// receives `[rows, w · size]`, rank `r`'s values in columns `r·w .. (r+1)·w` of each row.
pub trait Gather: Send {
    fn tp(&self) -> TpRank;
    fn all_gather(&mut self, mine: &[f32], rows: usize, out: &mut Vec<f32>) -> Result<(), TpError>;
    /// [`Gather::all_gather`] whose result only TP rank 0 needs (the logits: only rank 0
    /// samples); the other ranks publish their slices and go on, and `out` is left empty there.
    fn gather_to_rank0(&mut self, mine: &[f32], rows: usize, out: &mut Vec<f32>) -> Result<(), TpError> {
        self.all_gather(mine, rows, out)
    }
    /// Tell every rank the group can no longer be trusted (this rank's step failed part-way).
    fn poison(&self);
    /// Time spent in gathers so far (for the cost benchmark and diagnostics).
    fn time(&self) -> GatherTime {
        GatherTime::default()
    }
}

/// Where a rank's gathers spent their time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GatherTime {
    /// Inside `all_gather`, waiting included.
    pub total: Duration,
    /// Waiting for the other ranks to publish a round (their compute running longer than this
    /// rank's, or the scheduler running them later).
    pub waiting: Duration,
}

const MAGIC: u64 = u64::from_le_bytes(*b"PDMESHTP");
const POISON_OFF: usize = 16;
const RANK_OFF: usize = 64;
const RANK_STRIDE: usize = 64;
const DATA_OFF: usize = 4096;
/// A rank that waits this long for a gather fails its step (a peer process that is alive but
/// stuck); its own compute between two gathers is one matmul.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The all-gather between a node's TP processes over one shared-memory file (module docs).
pub struct ShmGroup {
    map: MmapMut,
    path: PathBuf,
    tp: TpRank,
    section_bytes: usize,
    round: u64,
    /// The last round this rank saw every rank publish.
    seen: u64,
    timeout: Duration,
    time: GatherTime,
}

impl std::fmt::Debug for ShmGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmGroup").field("path", &self.path).field("tp", &self.tp).finish_non_exhaustive()
    }
}

impl ShmGroup {
    /// The section each rank writes per round: room for one row of the widest gather
    /// (`widest` values) and at least 4 MiB, so a prefill's gathers take few rounds.
    pub fn section_bytes_for(widest: usize) -> usize {
        (widest * 4).max(4 << 20).next_multiple_of(4096)
    }

    /// Create the group's file (TP rank 0, before the other ranks start).
    pub fn create(path: &Path, size: usize, section_bytes: usize) -> Result<Self, TpError> {
        let setup = |why: String| TpError::Setup { path: path.display().to_string(), why };
        if size == 0 || size > MAX_TP_SIZE {
            return Err(setup(format!("size {size} is not 1..={MAX_TP_SIZE}")));
        }
        let len = DATA_OFF + 2 * size * section_bytes;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| setup(e.to_string()))?;
        file.set_len(len as u64).map_err(|e| setup(e.to_string()))?;
        // SAFETY: the file was just sized by us; other processes map it only to exchange
        // values through the protocol below, never to change its length.
        let mut map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| setup(e.to_string()))?;
        map[8..12].copy_from_slice(&(size as u32).to_le_bytes());
        map[12..16].copy_from_slice(&(section_bytes as u32).to_le_bytes());
        map[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        let g = Self::new(map, path, TpRank { rank: 0, size }, section_bytes);
        g.publish_pid();
        Ok(g)
    }

    /// Join the group TP rank 0 created at `path`, as `rank`.
    pub fn open(path: &Path, rank: usize) -> Result<Self, TpError> {
        let setup = |why: String| TpError::Setup { path: path.display().to_string(), why };
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(|e| setup(e.to_string()))?;
        // SAFETY: as in `create`.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| setup(e.to_string()))?;
        let word = |at: usize| map.get(at..at + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
        let magic = map.get(0..8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()));
        let (Some(MAGIC), Some(size), Some(section_bytes)) = (magic, word(8), word(12)) else {
            return Err(setup("not a TP group file".into()));
        };
        if size == 0 || size > MAX_TP_SIZE || rank >= size || map.len() < DATA_OFF + 2 * size * section_bytes {
            return Err(setup(format!("rank {rank} of a group of {size} ({} bytes)", map.len())));
        }
        let g = Self::new(map, path, TpRank { rank, size }, section_bytes);
        g.publish_pid();
        Ok(g)
    }

    fn new(map: MmapMut, path: &Path, tp: TpRank, section_bytes: usize) -> Self {
        let timeout = std::env::var("PDMESH_TP_GATHER_TIMEOUT_S")
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or(DEFAULT_TIMEOUT, Duration::from_secs);
        Self {
            map,
            path: path.to_path_buf(),
            tp,
            section_bytes,
            round: 0,
            seen: 0,
            timeout,
            time: GatherTime::default(),
        }
    }

    fn word64(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is 8-aligned and inside the header (checked at open); the mapping is
        // page-aligned and lives as long as `self`; every access to it goes through atomics.
        unsafe { &*(self.map.as_ptr().add(at).cast::<AtomicU64>()) }
    }

    fn word32(&self, at: usize) -> &AtomicU32 {
        // SAFETY: as in `word64` (4-aligned).
        unsafe { &*(self.map.as_ptr().add(at).cast::<AtomicU32>()) }
    }

    fn seq(&self, rank: usize) -> &AtomicU64 {
        self.word64(RANK_OFF + rank * RANK_STRIDE)
    }

    fn pid(&self, rank: usize) -> &AtomicU32 {
        self.word32(RANK_OFF + rank * RANK_STRIDE + 8)
    }

    fn publish_pid(&self) {
        self.seq(self.tp.rank).store(0, Ordering::Release);
        self.pid(self.tp.rank).store(std::process::id(), Ordering::Release);
    }

    /// Where rank `rank`'s section of round slot `slot` starts in the mapping.
    fn section(&self, slot: usize, rank: usize) -> usize {
        DATA_OFF + (slot * self.tp.size + rank) * self.section_bytes
    }

    /// The group's file (removed by TP rank 0 when it stops).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Wait until every rank has published `round`.
    fn wait_round(&self, round: u64) -> Result<(), TpError> {
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if (0..self.tp.size).all(|r| self.seq(r).load(Ordering::Acquire) >= round) {
                return Ok(());
            }
            if self.word32(POISON_OFF).load(Ordering::Acquire) != 0 {
                return Err(TpError::Poisoned);
            }
            spins = spins.wrapping_add(1);
            if spins < 2000 {
                std::hint::spin_loop();
                continue;
            }
            std::thread::yield_now();
            if spins.is_multiple_of(256) {
                self.check_peers()?;
                if started.elapsed() > self.timeout {
                    let rank = (0..self.tp.size).find(|&r| self.seq(r).load(Ordering::Acquire) < round).unwrap_or(0);
                    return Err(TpError::Timeout { rank, waited: started.elapsed() });
                }
            }
            if spins > 20_000 {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// A peer whose process is gone (its pid published, no such process any more).
    fn check_peers(&self) -> Result<(), TpError> {
        for r in (0..self.tp.size).filter(|&r| r != self.tp.rank) {
            let pid = self.pid(r).load(Ordering::Acquire);
            let Some(p) = rustix::process::Pid::from_raw(pid as i32) else { continue };
            if rustix::process::test_kill_process(p).is_err_and(|e| e == rustix::io::Errno::SRCH) {
                return Err(TpError::PeerGone { rank: r, pid });
            }
        }
        Ok(())
    }
}

impl Gather for ShmGroup {
    fn tp(&self) -> TpRank {
        self.tp
    }

    fn all_gather(&mut self, mine: &[f32], rows: usize, out: &mut Vec<f32>) -> Result<(), TpError> {
        self.gather_rounds(mine, rows, out, true)
    }

    fn gather_to_rank0(&mut self, mine: &[f32], rows: usize, out: &mut Vec<f32>) -> Result<(), TpError> {
        self.gather_rounds(mine, rows, out, self.tp.rank == 0)
    }

    fn poison(&self) {
        self.word32(POISON_OFF).store(1, Ordering::Release);
    }

    fn time(&self) -> GatherTime {
        self.time
    }
}

impl ShmGroup {
    /// One gather, timed; `read`: this rank reads the others' slices (else it only publishes
    /// its own, and `out` is left empty).
    fn gather_rounds(&mut self, mine: &[f32], rows: usize, out: &mut Vec<f32>, read: bool) -> Result<(), TpError> {
        let started = Instant::now();
        let r = self.rounds(mine, rows, out, read);
        self.time.total += started.elapsed();
        r
    }

    /// The rounds of one gather ([`ShmGroup::gather_rounds`]).
    fn rounds(&mut self, mine: &[f32], rows: usize, out: &mut Vec<f32>, read: bool) -> Result<(), TpError> {
        let n = self.tp.size;
        if rows == 0 || !mine.len().is_multiple_of(rows) {
            return Err(TpError::Shape { got: mine.len(), rows });
        }
        let w = mine.len() / rows;
        out.clear();
        if n == 1 {
            if read {
                out.extend_from_slice(mine);
            }
            return Ok(());
        }
        if read {
            out.resize(rows * w * n, 0.0);
        }
        if w * 4 > self.section_bytes {
            return Err(TpError::Setup {
                path: self.path.display().to_string(),
                why: format!("a row of {w} values does not fit a {}-byte section", self.section_bytes),
            });
        }
        let per_round = (self.section_bytes / (w * 4)).max(1);
        let me = self.tp.rank;
        let mut first = 0;
        while first < rows {
            let count = per_round.min(rows - first);
            self.round += 1;
            let slot = (self.round % 2) as usize;
            // The slot written now was read two rounds ago, and a rank publishes a round only
            // once it has read the one before: so once every rank has published the previous
            // round, nobody reads this slot any more. After a round this rank read, it saw
            // that already; after one it only published, it waits for it here.
            if self.seen + 1 < self.round {
                let waiting = Instant::now();
                self.wait_round(self.round - 1)?;
                self.seen = self.round - 1;
                self.time.waiting += waiting.elapsed();
            }
            let src = &mine[first * w..(first + count) * w];
            let at = self.section(slot, me);
            // SAFETY: `at .. at + count·w·4` lies inside this rank's section (count·w·4 ≤
            // section_bytes); no other rank reads it before `seq` below publishes it, and none
            // writes it: each rank writes only its own section.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr().cast::<u8>(), self.map.as_mut_ptr().add(at), src.len() * 4);
            }
            self.seq(me).store(self.round, Ordering::Release);
            if !read {
                first += count;
                continue;
            }
            let waiting = Instant::now();
            self.wait_round(self.round)?;
            self.seen = self.round;
            self.time.waiting += waiting.elapsed();
            for r in 0..n {
                let base = self.section(slot, r);
                for t in 0..count {
                    let dst = &mut out[(first + t) * w * n + r * w..][..w];
                    if r == me {
                        dst.copy_from_slice(&src[t * w..(t + 1) * w]);
                        continue;
                    }
                    // SAFETY: rank r published this round after writing its section (the
                    // Acquire load in `wait_round` orders this read after that write), and it
                    // writes that section again only two rounds on, which it cannot reach
                    // before this rank publishes the next round. Unaligned reads: the section
                    // offset is page-aligned and `t·w·4` a multiple of 4.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.map.as_ptr().add(base + t * w * 4),
                            dst.as_mut_ptr().cast::<u8>(),
                            w * 4,
                        );
                    }
                }
            }
            first += count;
        }
        Ok(())
    }
}

/// A handle that can poison a group from another thread than the one computing (the worker's
/// socket side, when a TP peer's link is lost while the executor waits in a gather).
#[derive(Debug, Clone)]
pub struct GroupPoison {
    path: PathBuf,
}

impl GroupPoison {
    pub fn new(path: &Path) -> Self {
        Self { path: path.to_path_buf() }
    }

    /// Mark the group poisoned: every rank waiting in a gather fails its step.
    pub fn poison(&self) {
        if let Ok(g) = ShmGroup::open_any(&self.path) {
            g.poison();
        }
    }
}

impl ShmGroup {
    /// The group at `path` as a bystander (for [`GroupPoison`]): no rank, no pid published.
    fn open_any(path: &Path) -> Result<Self, TpError> {
        let setup = |why: String| TpError::Setup { path: path.display().to_string(), why };
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(|e| setup(e.to_string()))?;
        // SAFETY: as in `create`.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(|e| setup(e.to_string()))?;
        if map.len() < DATA_OFF {
            return Err(setup("not a TP group file".into()));
        }
        Ok(Self::new(map, path, TpRank::SINGLE, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("pdmesh-tp-test-{name}-{}", std::process::id()))
    }

    /// Three ranks on threads gather `[rows, w]` each, over several rounds (a small section),
    /// twice in a row: every rank ends with every rank's columns in rank order.
    #[test]
    fn three_ranks_gather_whole_rows_in_rank_order_over_many_rounds() {
        let path = tmp("gather");
        let section = 4096;
        let g0 = ShmGroup::create(&path, 3, section).unwrap();
        let mut groups = [g0, ShmGroup::open(&path, 1).unwrap(), ShmGroup::open(&path, 2).unwrap()];
        let (rows, w) = (700, 3); // 700 rows of 12 bytes: three rounds of 341 rows
        let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .iter_mut()
                .map(|g| {
                    s.spawn(move || {
                        let r = g.tp().rank;
                        (0..2)
                            .map(|pass| {
                                let mine: Vec<f32> =
                                    (0..rows * w).map(|i| (pass * 100_000 + r * 10_000 + i) as f32).collect();
                                let mut out = Vec::new();
                                g.all_gather(&mine, rows, &mut out).unwrap();
                                out
                            })
                            .collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (pass, expected_pass) in (0..2).map(|p| (p, p * 100_000)) {
            let expected: Vec<f32> = (0..rows)
                .flat_map(|t| {
                    (0..3).flat_map(move |r| (0..w).map(move |j| (expected_pass + r * 10_000 + t * w + j) as f32))
                })
                .collect();
            for per_rank in &results {
                assert_eq!(per_rank[pass], expected, "pass {pass}");
            }
        }
        let _ = std::fs::remove_file(&path);
    }

    /// Gathers whose result only rank 0 reads, many rounds each, between ordinary gathers:
    /// rank 0 still gets every slice right (the publishing rank never overwrites a slot rank 0
    /// has not read), and the other rank's `out` stays empty.
    #[test]
    fn gathers_to_rank0_interleave_with_all_gathers() {
        let path = tmp("to-rank0");
        let g0 = ShmGroup::create(&path, 3, 4096).unwrap();
        let mut groups = [g0, ShmGroup::open(&path, 1).unwrap(), ShmGroup::open(&path, 2).unwrap()];
        let (rows, w) = (1000, 2); // 8 000 bytes a rank: two rounds a gather
        let results: Vec<Vec<(usize, Vec<f32>)>> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .iter_mut()
                .map(|g| {
                    s.spawn(move || {
                        let r = g.tp().rank;
                        (0..60)
                            .map(|pass| {
                                let mine: Vec<f32> =
                                    (0..rows * w).map(|i| (pass * 100_000 + r * 10_000 + i) as f32).collect();
                                let mut out = Vec::new();
                                if pass % 2 == 0 {
                                    g.gather_to_rank0(&mine, rows, &mut out).unwrap();
                                } else {
                                    g.all_gather(&mine, rows, &mut out).unwrap();
                                }
                                (pass, out)
                            })
                            .collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (pass, out) in &results[0] {
            let want: Vec<f32> = (0..rows)
                .flat_map(|t| {
                    (0..3).flat_map(move |r| (0..w).map(move |j| (pass * 100_000 + r * 10_000 + t * w + j) as f32))
                })
                .collect();
            assert!(out == &want, "rank 0, pass {pass}: another round's values");
        }
        for (pass, out) in results[1].iter().chain(&results[2]) {
            assert_eq!(out.is_empty(), pass % 2 == 0, "ranks 1, 2, pass {pass}");
        }
        let _ = std::fs::remove_file(&path);
    }

    /// A rank waiting for a peer that never comes fails once the group is poisoned, instead
    /// of waiting forever.
    #[test]
    fn a_poisoned_group_fails_the_waiting_rank() {
        let path = tmp("poison");
        let mut g0 = ShmGroup::create(&path, 2, 4096).unwrap();
        let _g1 = ShmGroup::open(&path, 1).unwrap();
        let poison = GroupPoison::new(&path);
        let waiter = std::thread::spawn(move || {
            let mut out = Vec::new();
            g0.all_gather(&[1.0, 2.0], 1, &mut out)
        });
        std::thread::sleep(Duration::from_millis(20));
        poison.poison();
        assert!(matches!(waiter.join().unwrap(), Err(TpError::Poisoned)));
        let _ = std::fs::remove_file(&path);
    }

    /// A peer whose process is gone is noticed by pid.
    #[test]
    fn a_dead_peer_fails_the_gather() {
        let path = tmp("dead");
        let mut g0 = ShmGroup::create(&path, 2, 4096).unwrap();
        let g1 = ShmGroup::open(&path, 1).unwrap();
        // a pid no process has: above the kernel's pid limit
        g1.pid(1).store(i32::MAX as u32 - 1, Ordering::Release);
        let mut out = Vec::new();
        match g0.all_gather(&[1.0], 1, &mut out) {
            Err(TpError::PeerGone { rank: 1, .. }) => {}
            other => panic!("{other:?}"),
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn splits_follow_heads_and_replicate_kv_heads_past_their_count() {
        let t = |rank| TpRank { rank, size: 4 };
        assert_eq!(t(1).share(896), 224..448);
        assert_eq!(t(3).kv_heads(8), 6..8);
        // 2 KV heads over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1
        assert_eq!((0..4).map(|r| t(r).kv_heads(2).start).collect::<Vec<_>>(), vec![0, 0, 1, 1]);
    }
}
