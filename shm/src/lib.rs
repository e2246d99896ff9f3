//! A ledger of device memory held by the processes of one slice, in a small file every process
//! maps (`<slice dir>/memory`). It is what makes a cap exact across processes without a lock:
//!
//! - each (process, device) pair owns one row; only its owner changes the row's byte count;
//! - the total on a device is the sum of its rows, and a charge is optimistic: add to your row,
//!   sum, and take it back if the sum went past the cap (then retry while it would fit alone);
//! - a process killed at any instant leaves its row exactly as large as what it holds, so
//!   reclaiming the rows of dead processes brings the total back to exactly what the living hold.
//!
//! A workload can scribble over this file, but only its own slice's: limits never come from here.

use std::fs::OpenOptions;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// "gpuslice" in ASCII, then the layout version.
const MAGIC: u64 = 0x6770_7573_6c69_6365;
const VERSION: u32 = 1;
/// Rows in a ledger: processes × devices a slice can have at once.
pub const ROWS: u32 = 1024;
/// A row being reclaimed: nobody may claim it until it is free again.
const RECLAIMING: u64 = u64::MAX;
/// How often a charge that would fit alone retries after losing a race.
const RETRIES: u32 = 64;

#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    rows: AtomicU32,
    /// Rows ever used: sums stop here.
    high_water: AtomicU32,
    _pad: u32,
    /// Allocations refused at the cap (counted by the shim, once per refused call).
    refusals: AtomicU64,
    /// The most bytes held on one device at once since the ledger was made or last reset.
    peak: AtomicU64,
    // Zero in a version-1 file written before the counters existed: they start from zero.
    _reserved: [u32; 6],
}

#[repr(C)]
struct Row {
    /// `pid + 1` of the owner (0: free; [`RECLAIMING`]).
    owner: AtomicU64,
    /// The owner's start time (clock ticks since boot), to tell a reused pid apart.
    start: AtomicU64,
    device: AtomicU32,
    _pad: u32,
    bytes: AtomicU64,
}

const HEADER: usize = std::mem::size_of::<Header>();
// Every process maps the same layout: the header must stay 64 bytes.
const _: () = assert!(HEADER == 64);
const ROW: usize = std::mem::size_of::<Row>();
pub const FILE_SIZE: usize = HEADER + ROWS as usize * ROW;

/// Why a ledger cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a gpuslice memory ledger (wrong size or header)")]
    Format { path: String },
    #[error("{path}: all {ROWS} rows are held by live processes")]
    Full { path: String },
}

/// A process as the ledger knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Process {
    pub pid: u32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22); 0 if unknown.
    pub start: u64,
}

impl Process {
    /// This process.
    pub fn current() -> Process {
        let pid = std::process::id();
        Process {
            pid,
            start: start_time(pid).unwrap_or(0),
        }
    }
}

/// A mapped ledger.
pub struct Ledger {
    map: memmap2::MmapRaw,
    path: String,
}

/// A row owned by this process for one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowId(u32);

impl Ledger {
    /// Maps the ledger at `path`, creating it (zeroed, then stamped) when absent.
    pub fn open(path: &Path) -> Result<Ledger, LedgerError> {
        let shown = path.display().to_string();
        let io = |source| LedgerError::Io {
            path: shown.clone(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            file.set_len(FILE_SIZE as u64).map_err(io)?;
        } else if len != FILE_SIZE as u64 {
            return Err(LedgerError::Format { path: shown });
        }
        let map = memmap2::MmapOptions::new()
            .len(FILE_SIZE)
            .map_raw(&file)
            .map_err(io)?;
        let ledger = Ledger { map, path: shown };
        let header = ledger.header();
        // Whoever stamps first wins; a zeroed file is a fresh one.
        if header
            .magic
            .compare_exchange(0, MAGIC, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            header.version.store(VERSION, Ordering::Release);
            header.rows.store(ROWS, Ordering::Release);
        } else if header.magic.load(Ordering::Acquire) != MAGIC {
            return Err(LedgerError::Format { path: ledger.path });
        }
        Ok(ledger)
    }

    fn header(&self) -> &Header {
        // SAFETY: the map is FILE_SIZE bytes, page-aligned, and Header is made of atomics, which
        // any bit pattern (including another process's writes) leaves valid.
        unsafe { &*self.map.as_ptr().cast::<Header>() }
    }

    fn row(&self, index: u32) -> &Row {
        debug_assert!(index < ROWS);
        // SAFETY: index < ROWS keeps the row inside the map; rows are 8-aligned after a
        // 64-byte header, and made of atomics.
        unsafe {
            &*self
                .map
                .as_ptr()
                .add(HEADER + index as usize * ROW)
                .cast::<Row>()
        }
    }

    fn used_rows(&self) -> u32 {
        self.header().high_water.load(Ordering::Acquire).min(ROWS)
    }

    /// The row of `process` for `device`, claiming a free one the first time.
    pub fn row_for(&self, process: Process, device: u32) -> Result<RowId, LedgerError> {
        let owner = u64::from(process.pid) + 1;
        for i in 0..self.used_rows() {
            let row = self.row(i);
            if row.owner.load(Ordering::Acquire) == owner
                && row.device.load(Ordering::Acquire) == device
                && row.start.load(Ordering::Acquire) == process.start
            {
                return Ok(RowId(i));
            }
        }
        for i in 0..ROWS {
            let row = self.row(i);
            if row
                .owner
                .compare_exchange(0, owner, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                row.start.store(process.start, Ordering::Release);
                row.device.store(device, Ordering::Release);
                row.bytes.store(0, Ordering::Release);
                self.header().high_water.fetch_max(i + 1, Ordering::AcqRel);
                return Ok(RowId(i));
            }
        }
        Err(LedgerError::Full {
            path: self.path.clone(),
        })
    }

    /// Bytes held on every device by every process in the ledger.
    pub fn total(&self) -> u64 {
        self.sum(|_| true)
    }

    /// Bytes held on `device` by every process in the ledger.
    pub fn used(&self, device: u32) -> u64 {
        self.sum(|d| d == device)
    }

    fn sum(&self, on_device: impl Fn(u32) -> bool) -> u64 {
        let mut total = 0u64;
        for i in 0..self.used_rows() {
            let row = self.row(i);
            let owner = row.owner.load(Ordering::Acquire);
            if owner != 0 && owner != RECLAIMING && on_device(row.device.load(Ordering::Acquire)) {
                total = total.saturating_add(row.bytes.load(Ordering::SeqCst));
            }
        }
        total
    }

    /// Bytes held through one row.
    pub fn held(&self, row: RowId) -> u64 {
        self.row(row.0).bytes.load(Ordering::Acquire)
    }

    /// Takes `bytes` on the row's device if the device total stays within `cap`. Never fails a
    /// charge that fits: one that loses a race retries while it would fit alone.
    pub fn try_charge(&self, row: RowId, bytes: u64, cap: u64) -> bool {
        let r = self.row(row.0);
        let device = r.device.load(Ordering::Acquire);
        for _ in 0..RETRIES {
            // SeqCst here and in `used`: two racing charges must not both miss each other's add.
            r.bytes.fetch_add(bytes, Ordering::SeqCst);
            let used = self.used(device);
            if used <= cap {
                self.header().peak.fetch_max(used, Ordering::AcqRel);
                return true;
            }
            r.bytes.fetch_sub(bytes, Ordering::SeqCst);
            if self.used(device).saturating_add(bytes) > cap {
                return false;
            }
            std::thread::yield_now();
        }
        false
    }

    /// Takes `bytes` whatever the cap (what the driver took on its own, like a context).
    pub fn charge(&self, row: RowId, bytes: u64) {
        let r = self.row(row.0);
        r.bytes.fetch_add(bytes, Ordering::AcqRel);
        let used = self.used(r.device.load(Ordering::Acquire));
        self.header().peak.fetch_max(used, Ordering::AcqRel);
    }

    /// Counts an allocation refused at the cap (the caller's final answer, after any retry).
    pub fn count_refusal(&self) {
        self.header().refusals.fetch_add(1, Ordering::AcqRel);
    }

    /// Allocations refused at the cap so far.
    pub fn refusals(&self) -> u64 {
        self.header().refusals.load(Ordering::Acquire)
    }

    /// The most bytes held on one device at once since the ledger was made or last reset.
    pub fn peak(&self) -> u64 {
        self.header().peak.load(Ordering::Acquire)
    }

    /// Starts the high-water mark again from what is held now (a new workload on the slice).
    pub fn reset_peak(&self) {
        let now = self
            .rows()
            .iter()
            .map(|(_, device, _)| self.used(*device))
            .max()
            .unwrap_or(0);
        self.header().peak.store(now, Ordering::Release);
    }

    /// Gives back `bytes` taken through the row.
    pub fn release(&self, row: RowId, bytes: u64) {
        let r = &self.row(row.0).bytes;
        let mut current = r.load(Ordering::Acquire);
        loop {
            let next = current.saturating_sub(bytes);
            match r.compare_exchange(current, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(seen) => current = seen,
            }
        }
    }

    /// Frees the rows of processes that are gone. Returns the bytes they held.
    pub fn reclaim(&self, alive: impl Fn(Process) -> bool) -> u64 {
        let mut freed = 0;
        for i in 0..self.used_rows() {
            let row = self.row(i);
            let owner = row.owner.load(Ordering::Acquire);
            if owner == 0 || owner == RECLAIMING {
                continue;
            }
            let process = Process {
                pid: (owner - 1) as u32,
                start: row.start.load(Ordering::Acquire),
            };
            if alive(process) {
                continue;
            }
            if row
                .owner
                .compare_exchange(owner, RECLAIMING, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                freed += row.bytes.swap(0, Ordering::AcqRel);
                row.owner.store(0, Ordering::Release);
            }
        }
        freed
    }

    /// Every live row: (process, device, bytes).
    pub fn rows(&self) -> Vec<(Process, u32, u64)> {
        (0..self.used_rows())
            .filter_map(|i| {
                let row = self.row(i);
                let owner = row.owner.load(Ordering::Acquire);
                (owner != 0 && owner != RECLAIMING).then(|| {
                    (
                        Process {
                            pid: (owner - 1) as u32,
                            start: row.start.load(Ordering::Acquire),
                        },
                        row.device.load(Ordering::Acquire),
                        row.bytes.load(Ordering::Acquire),
                    )
                })
            })
            .collect()
    }
}

/// A process's start time in clock ticks since boot, from `/proc/<pid>/stat`.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (in parentheses, which may hold spaces): state is field 3,
    // start time field 22.
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether a process still runs: it exists, is not a zombie, and started when the ledger says
/// (a pid reused by another process is not the same process).
pub fn alive(process: Process) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", process.pid)) else {
        return false;
    };
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return false;
    };
    let mut fields = rest.split_whitespace();
    if matches!(fields.next(), Some("Z" | "X") | None) {
        return false;
    }
    process.start == 0 || fields.nth(18).and_then(|s| s.parse().ok()) == Some(process.start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_stop_exactly_at_the_cap_and_dead_rows_are_reclaimed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        let ledger = Ledger::open(&path).unwrap();
        let me = Process::current();
        let other = Process {
            pid: 999_999_999,
            start: 7,
        };
        let mine = ledger.row_for(me, 0).unwrap();
        let theirs = ledger.row_for(other, 0).unwrap();
        assert_ne!(mine, theirs);
        assert_eq!(
            ledger.row_for(me, 0).unwrap(),
            mine,
            "one row per process and device"
        );
        assert!(ledger.try_charge(mine, 600, 1000));
        assert!(ledger.try_charge(theirs, 400, 1000), "exactly at the cap");
        assert!(!ledger.try_charge(mine, 1, 1000));
        ledger.count_refusal();
        assert_eq!(ledger.used(0), 1000);
        assert_eq!((ledger.peak(), ledger.refusals()), (1000, 1));
        assert_eq!(ledger.used(1), 0);

        // Another mapping sees the same ledger.
        let again = Ledger::open(&path).unwrap();
        assert_eq!(again.used(0), 1000);
        assert_eq!(
            again.reclaim(alive),
            400,
            "the made-up process is not alive"
        );
        assert_eq!(ledger.used(0), 600);
        assert_eq!(
            again.peak(),
            1000,
            "the high-water mark stays after a release"
        );
        again.reset_peak();
        assert_eq!(
            ledger.peak(),
            600,
            "a reset starts again from what is held now"
        );
        ledger.release(mine, 600);
        assert_eq!(ledger.used(0), 0);
        assert_eq!(ledger.refusals(), 1);
    }

    #[test]
    fn concurrent_charges_never_pass_the_cap_and_never_fail_when_they_fit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        Ledger::open(&path).unwrap();
        let cap = 64 * 100;
        let workers: Vec<_> = (0..8u32)
            .map(|w| {
                let path = path.clone();
                std::thread::spawn(move || {
                    let ledger = Ledger::open(&path).unwrap();
                    let row = ledger
                        .row_for(
                            Process {
                                pid: 4_000_000 + w,
                                start: 1,
                            },
                            0,
                        )
                        .unwrap();
                    for _ in 0..2000 {
                        // 8 workers × at most 8 × 100 bytes held = the cap: every charge fits.
                        for _ in 0..8 {
                            assert!(ledger.try_charge(row, 100, cap));
                        }
                        ledger.release(row, 800);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        assert_eq!(Ledger::open(&path).unwrap().used(0), 0);
    }

    #[test]
    fn a_file_that_is_not_a_ledger_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        std::fs::write(&path, b"not a ledger").unwrap();
        assert!(matches!(
            Ledger::open(&path),
            Err(LedgerError::Format { .. })
        ));
    }
}
