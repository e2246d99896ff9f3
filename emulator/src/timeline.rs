//! One emulated GPU's timeline, shared by every process on the machine: kernels from different
//! processes never run at the same time (a GPU without MPS runs one context at a time), each runs
//! for the time it was launched with, and every kernel is recorded with the process that ran it,
//! so a benchmark can measure exactly which process had the GPU when.
//!
//! The file (`<state>.timeline-<device key>`) holds a header with the instant the GPU is busy
//! until and a fixed array of records. A launch reserves its interval with one compare-and-swap
//! on that instant: kernels run in the order they were launched, as the driver queues them.
//! Times are `CLOCK_MONOTONIC` nanoseconds, the same clock in every process.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memmap2::MmapMut;

/// "gpu-time" in ASCII.
const MAGIC: u64 = 0x6770_752d_7469_6d65;
/// Kernels recorded per device; later ones still run, unrecorded.
pub const CAPACITY: u64 = 1 << 20;

#[repr(C)]
struct Header {
    magic: AtomicU64,
    busy_until: AtomicU64,
    /// Records claimed (may pass [`CAPACITY`]: those were not recorded).
    count: AtomicU64,
    _reserved: [u64; 5],
}

#[repr(C)]
struct Record {
    pid: AtomicU32,
    /// Percent of the GPU's SMs the kernel ran on: 100, or an MPS client's share.
    share: AtomicU32,
    start: AtomicU64,
    /// Written last: 0 while the record is being filled.
    end: AtomicU64,
}

const HEADER: usize = std::mem::size_of::<Header>();
const RECORD: usize = std::mem::size_of::<Record>();
const FILE_SIZE: usize = HEADER + CAPACITY as usize * RECORD;

/// A kernel that ran: who, from when to when (monotonic nanoseconds), on what percent of the
/// GPU's SMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interval {
    pub pid: u32,
    pub start: u64,
    pub end: u64,
    pub share: u32,
}

impl Interval {
    /// The GPU time it used within `[from, to)`: its overlap, weighted by its share of the SMs.
    pub fn used_within(&self, from: u64, to: u64) -> u64 {
        self.end.min(to).saturating_sub(self.start.max(from)) * u64::from(self.share) / 100
    }
}

#[derive(Debug, thiserror::Error)]
#[error("GPU timeline {path}: {source}")]
pub struct TimelineError {
    path: String,
    source: std::io::Error,
}

/// Where the timeline of a device (see [`crate::device_key`]) lives, next to the state file.
pub fn timeline_path(state: &Path, key: u32) -> PathBuf {
    state.with_extension(format!("timeline-{key:08x}"))
}

/// Now, in `CLOCK_MONOTONIC` nanoseconds. Through libc (not rustix's own vDSO lookup, which
/// faults under valgrind) so that the compute benchmark can count instructions under callgrind.
pub fn now_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `t` is; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// A mapped timeline.
pub struct Timeline {
    map: MmapMut,
}

impl Timeline {
    /// Opens the timeline at `path`, creating it (sparse) if needed.
    pub fn open(path: &Path) -> Result<Timeline, TimelineError> {
        let error = |source| TimelineError {
            path: path.display().to_string(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(error)?;
        if file.metadata().map_err(error)?.len() < FILE_SIZE as u64 {
            file.set_len(FILE_SIZE as u64).map_err(error)?;
        }
        // SAFETY: a regular file of FILE_SIZE bytes that only ever holds plain integers; every
        // access goes through atomics, so concurrent writers in other processes are sound.
        let map = unsafe { MmapMut::map_mut(&file) }.map_err(error)?;
        let timeline = Timeline { map };
        // A fresh file is all zeroes, which is already a valid empty timeline.
        let _ =
            timeline
                .header()
                .magic
                .compare_exchange(0, MAGIC, Ordering::AcqRel, Ordering::Acquire);
        Ok(timeline)
    }

    fn header(&self) -> &Header {
        // SAFETY: the map is FILE_SIZE bytes, page-aligned, and Header is atomics only.
        unsafe { &*(self.map.as_ptr() as *const Header) }
    }

    fn record(&self, index: u64) -> &Record {
        debug_assert!(index < CAPACITY);
        // SAFETY: index < CAPACITY keeps the record inside the map; records are 8-aligned atomics.
        unsafe { &*(self.map.as_ptr().add(HEADER + index as usize * RECORD) as *const Record) }
    }

    /// Runs a kernel of `duration` nanoseconds for `pid` that is ready (its stream's earlier work
    /// done) at `ready`: it starts when the GPU is free, after every kernel launched before it.
    /// Returns when it ends.
    pub fn run(&self, pid: u32, ready: u64, duration: u64) -> u64 {
        if duration == 0 {
            return ready.max(self.header().busy_until.load(Ordering::Acquire));
        }
        let busy = &self.header().busy_until;
        let mut current = busy.load(Ordering::Acquire);
        let (start, end) = loop {
            let start = ready.max(current);
            let end = start + duration;
            match busy.compare_exchange_weak(current, end, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break (start, end),
                Err(seen) => current = seen,
            }
        };
        self.record_kernel(pid, start, end, 100);
        end
    }

    /// Runs a kernel of an MPS client on `share` percent of the SMs: it starts when its stream
    /// is ready, beside other clients' kernels (MPS runs them at the same time, each on its own
    /// SMs), and takes `duration × 100 / share`, `duration` being its time on the whole GPU.
    /// Returns when it ends.
    pub fn run_beside(&self, pid: u32, ready: u64, duration: u64, share: u32) -> u64 {
        let share = share.clamp(1, 100);
        if duration == 0 {
            return ready;
        }
        let end = ready + duration * 100 / u64::from(share);
        self.record_kernel(pid, ready, end, share);
        end
    }

    fn record_kernel(&self, pid: u32, start: u64, end: u64, share: u32) {
        let index = self.header().count.fetch_add(1, Ordering::AcqRel);
        if index < CAPACITY {
            let record = self.record(index);
            record.pid.store(pid, Ordering::Relaxed);
            record.share.store(share, Ordering::Relaxed);
            record.start.store(start, Ordering::Relaxed);
            record.end.store(end, Ordering::Release);
        }
    }

    /// Every recorded kernel, in launch order.
    pub fn intervals(&self) -> Vec<Interval> {
        let count = self.header().count.load(Ordering::Acquire).min(CAPACITY);
        (0..count)
            .map(|i| self.record(i))
            .filter_map(|r| {
                let end = r.end.load(Ordering::Acquire);
                (end != 0).then(|| Interval {
                    pid: r.pid.load(Ordering::Relaxed),
                    start: r.start.load(Ordering::Relaxed),
                    end,
                    share: r.share.load(Ordering::Relaxed),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_of_two_processes_never_overlap_and_run_their_length() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpu.timeline");
        let a = Timeline::open(&path).unwrap();
        let b = Timeline::open(&path).unwrap();
        let t0 = 1_000;
        assert_eq!(a.run(1, t0, 500), t0 + 500);
        // Ready earlier than the GPU is free: waits for the first kernel.
        assert_eq!(b.run(2, t0 + 100, 300), t0 + 800);
        // Ready after the GPU went idle: starts at once.
        assert_eq!(a.run(1, t0 + 2_000, 100), t0 + 2_100);
        assert_eq!(
            b.intervals(),
            [
                Interval {
                    pid: 1,
                    start: t0,
                    end: t0 + 500,
                    share: 100,
                },
                Interval {
                    pid: 2,
                    start: t0 + 500,
                    end: t0 + 800,
                    share: 100,
                },
                Interval {
                    pid: 1,
                    start: t0 + 2_000,
                    end: t0 + 2_100,
                    share: 100,
                },
            ]
        );
    }

    #[test]
    fn mps_clients_run_side_by_side_each_on_its_share_of_the_sms() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpu.timeline");
        let t = Timeline::open(&path).unwrap();
        let t0 = 1_000;
        // A 1 ms kernel on a quarter of the SMs takes 4 ms; its neighbour's does not wait.
        assert_eq!(t.run_beside(1, t0, 1_000_000, 25), t0 + 4_000_000);
        assert_eq!(t.run_beside(2, t0, 1_000_000, 75), t0 + 1_333_333);
        let used: u64 = t
            .intervals()
            .iter()
            .map(|k| k.used_within(t0, t0 + 4_000_000))
            .sum();
        // Each used its share for as long as it ran: 1 ms of the whole GPU apiece.
        assert_eq!(used, 1_000_000 + 999_999);
    }

    #[test]
    fn concurrent_launches_partition_the_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpu.timeline");
        std::thread::scope(|s| {
            for pid in 1..=4 {
                let path = &path;
                s.spawn(move || {
                    let t = Timeline::open(path).unwrap();
                    for _ in 0..1000 {
                        t.run(pid, 0, 10);
                    }
                });
            }
        });
        let mut all = Timeline::open(&path).unwrap().intervals();
        assert_eq!(all.len(), 4000);
        all.sort_by_key(|i| i.start);
        for pair in all.windows(2) {
            assert_eq!(
                pair[0].end, pair[1].start,
                "back to back, never overlapping"
            );
        }
    }
}
