//! The pool of KV-cache blocks of one engine rank.
//!
//! The pool only knows free versus allocated; who holds an allocated block (a live request,
//! or the connector for a remote reader) is the scheduler's business. Each block carries a
//! generation that is bumped every time it is freed, so a reference handed to a remote reader
//! (`remote_block_generations`) can be checked against reuse. A double free is refused and
//! counted, never a panic.

use std::collections::VecDeque;

#[derive(Debug)]
pub struct BlockPool {
    free: VecDeque<u32>,
    allocated: Vec<bool>,
    generation: Vec<u64>,
    double_frees: u64,
}

impl BlockPool {
    pub fn new(num_blocks: u32) -> Self {
        Self {
            free: (0..num_blocks).collect(),
            allocated: vec![false; num_blocks as usize],
            generation: vec![0; num_blocks as usize],
            double_frees: 0,
        }
    }

    pub fn num_blocks(&self) -> u32 {
        self.allocated.len() as u32
    }

    pub fn num_free(&self) -> u32 {
        self.free.len() as u32
    }

    /// Take `n` blocks, or none at all if fewer are free.
    pub fn allocate(&mut self, n: u32) -> Option<Vec<u32>> {
        if n as usize > self.free.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let b = self.free.pop_front()?;
            if let Some(a) = self.allocated.get_mut(b as usize) {
                *a = true;
            }
            out.push(b);
        }
        Some(out)
    }

    /// Return blocks to the pool. Blocks that are not allocated (double free, or out of
    /// range) are skipped and counted; returns how many were refused.
    pub fn free(&mut self, blocks: &[u32]) -> u32 {
        let mut refused = 0;
        for &b in blocks {
            match self.allocated.get_mut(b as usize) {
                Some(a) if *a => {
                    *a = false;
                    if let Some(g) = self.generation.get_mut(b as usize) {
                        *g += 1;
                    }
                    self.free.push_back(b);
                }
                _ => {
                    refused += 1;
                }
            }
        }
        if refused > 0 {
            self.double_frees += u64::from(refused);
            tracing::error!(refused, "refused to free blocks that are not allocated");
        }
        refused
    }

    pub fn generation(&self, block: u32) -> Option<u64> {
        self.generation.get(block as usize).copied()
    }

    pub fn is_allocated(&self, block: u32) -> bool {
        self.allocated.get(block as usize).copied().unwrap_or(false)
    }

    pub fn double_frees(&self) -> u64 {
        self.double_frees
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_free_and_generations() {
        let mut p = BlockPool::new(4);
        let a = p.allocate(3).unwrap();
        assert_eq!(p.num_free(), 1);
        assert!(p.allocate(2).is_none(), "all-or-nothing");
        assert_eq!(p.num_free(), 1);
        let g0 = p.generation(a[0]).unwrap();
        assert_eq!(p.free(&a[..1]), 0);
        assert_eq!(p.generation(a[0]).unwrap(), g0 + 1);
        assert_eq!(p.free(&a[..1]), 1, "double free refused");
        assert_eq!(p.free(&[99]), 1, "out of range refused");
        assert_eq!(p.double_frees(), 2);
        assert_eq!(p.num_free(), 2);
    }
}
