use std::hint::black_box;
use std::time::{Duration, Instant};
use pdmesh_kv_transfer::ShmRegion;
use pdmesh_model_api::kv_cache::KvBacking;
fn median(mut xs: Vec<Duration>) -> Duration { xs.sort(); xs[xs.len()/2] }
fn conv(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) { *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]); }
}
fn main() {
    let run = 12288usize; let runs_per_block = 60; let nb = 32usize;
    let total_blocks = 256usize;
    let total = total_blocks * run * runs_per_block;
    let bytes = nb * run * runs_per_block;
    let src = vec![1u8; total];
    let mut region = ShmRegion::create("pdmesh-micro", total).unwrap();
    region.as_mut_slice().fill(1.0);
    let ro = ShmRegion::open_readonly(region.path()).unwrap();
    let shm = ro.bytes();
    let mut dstb = vec![0u8; total];
    let mut dstf = vec![0f32; total / 4];
    dstf.fill(1.0); dstb.fill(1);
    let lsz = total_blocks * run; let heapf = vec![1f32; total/4];
    for _ in 0..3 {
    let mut t = [vec![], vec![], vec![], vec![]];
    for _ in 0..31 {
        let srcf = &heapf; let s = Instant::now(); for ls in 0..runs_per_block { for b in 0..nb { let off = (ls*lsz + b*run)/4; let doff = (ls*lsz + (nb-1-b)*run)/4; dstf[doff..doff+run/4].copy_from_slice(&srcf[off..off+run/4]); } } black_box(&mut dstf); t[0].push(s.elapsed());
        let s = Instant::now(); dstb[..bytes].copy_from_slice(&shm[..bytes]); black_box(&mut dstb); t[1].push(s.elapsed());
        let s = Instant::now();
        let rof = ro.floats();
        for ls in 0..runs_per_block { for b in 0..nb { let off = (ls*lsz + b*run)/4; let doff = (ls*lsz + (nb-1-b)*run)/4; dstf[doff..doff+run/4].copy_from_slice(&rof[off..off+run/4]); } }
        black_box(&mut dstf); t[2].push(s.elapsed());
        let s = Instant::now();
        let shmf = region.as_slice();
        for ls in 0..runs_per_block { for b in 0..nb { let off = (ls*lsz + b*run)/4; let doff = (ls*lsz + (nb-1-b)*run)/4; dstf[doff..doff+run/4].copy_from_slice(&shmf[off..off+run/4]); } }
        black_box(&mut dstf); t[3].push(s.elapsed());
    }
    let names = ["layer-major memcpy heap src", "big memcpy from shm", "layer-major memcpy RO map", "layer-major memcpy RW map"];
    for (i, v) in t.into_iter().enumerate() { let d = median(v); println!("{:30} {:.2} GB/s", names[i], bytes as f64 / d.as_secs_f64() / 1e9); }
    println!();
    }
    
}
