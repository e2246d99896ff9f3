//! A ledger of device memory held by the processes of one slice, in a small file every process
//! maps (`<slice dir>/memory`). It is what makes a cap exact across processes without a lock:
//!
//! - each (process, device) pair owns one row; only its owner changes the row's byte count;
//! - the total on a device is the sum of its rows, and a charge is optimistic: add to your row,
//!   sum, and take it back if the sum went past the cap (then retry while it would fit alone);
//! - a process killed at any instant leaves its row exactly as large as what it holds, so
//!   reclaiming the rows of dead processes brings the total back to exactly what the living hold.
//!
//! A workload can scribble over this file, but only its own slice's: limits never come from here
//! (the node agent's memory watchdog checks what the driver says each process holds).
//!
//! Processes of one slice may live in different pid namespaces (the containers of a pod): each
//! row names its owner's pid namespace, a pid is only looked up in its own namespace, and a
//! process judges only rows of its namespace. Rows of other namespaces are the node agent's to
//! reclaim ([`HostProcesses`]): it sees every namespace.

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
    /// The owner's pid namespace (the low 32 bits of its inode; 0: unknown, as in rows written
    /// before namespaces were recorded).
    pidns: AtomicU32,
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Process {
    /// Its pid in its own pid namespace.
    pub pid: u32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22); 0 if unknown.
    pub start: u64,
    /// Its pid namespace (low 32 bits of the inode); 0 if unknown.
    pub pidns: u32,
}

impl Process {
    /// This process.
    pub fn current() -> Process {
        let pid = std::process::id();
        Process {
            pid,
            start: start_time(pid).unwrap_or(0),
            pidns: pid_namespace("self").unwrap_or(0),
        }
    }
}

/// The pid namespace of a process (`self` or a pid as seen here), from `/proc/<p>/ns/pid`
/// (`pid:[4026531836]`): the low 32 bits of its inode (the kernel numbers namespaces below 2³²).
pub fn pid_namespace(process: &str) -> Option<u32> {
    let link = std::fs::read_link(format!("/proc/{process}/ns/pid")).ok()?;
    let text = link.to_str()?;
    let inode: u64 = text
        .strip_prefix("pid:[")?
        .strip_suffix(']')?
        .parse()
        .ok()?;
    Some(inode as u32)
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
        use std::os::unix::fs::OpenOptionsExt as _;
        // Never through a symbolic link: the slice's directory is the workload's to write, and
        // the root agent opens this file too.
        const O_NOFOLLOW: i32 = 0o400_000;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(O_NOFOLLOW)
            .open(path)
            .map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.file_type().is_file() {
            return Err(LedgerError::Format { path: shown });
        }
        let len = meta.len();
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
                && row.pidns.load(Ordering::Acquire) == process.pidns
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
                row.pidns.store(process.pidns, Ordering::Release);
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
                pidns: row.pidns.load(Ordering::Acquire),
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
                            pidns: row.pidns.load(Ordering::Acquire),
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

/// Whether a process still runs, as far as this process can tell: one of another pid
/// namespace is taken to (its pid means nothing here; the node agent judges it); one of this
/// namespace exists, is not a zombie, and started when the ledger says (a pid reused by
/// another process is not the same process).
pub fn alive(process: Process) -> bool {
    if process.pidns != 0 && Some(process.pidns) != own_pid_namespace() {
        return true;
    }
    alive_here(process)
}

fn own_pid_namespace() -> Option<u32> {
    static OWN: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    *OWN.get_or_init(|| pid_namespace("self"))
}

/// What the host's `/proc` shows of every process: its pid namespace and its pid there (the
/// last of `NSpid`), with its start time. Taken by the node agent, which sees all namespaces.
#[derive(Debug, Default)]
pub struct HostProcesses {
    namespaces: std::collections::HashSet<u32>,
    /// (pid namespace, pid there) → (start time, pid here).
    by_namespace: std::collections::HashMap<(u32, u32), (u64, u32)>,
}

impl HostProcesses {
    /// Reads `/proc` (processes that end while it reads are left out).
    pub fn read() -> HostProcesses {
        let mut host = HostProcesses::default();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return host;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let (Some(ns), Some(start)) = (pid_namespace(&pid.to_string()), start_time(pid)) else {
                continue;
            };
            let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
                continue;
            };
            let Some(inner) = status
                .lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .and_then(|l| l.split_whitespace().last())
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            host.namespaces.insert(ns);
            host.by_namespace.insert((ns, inner), (start, pid));
        }
        host
    }

    /// Whether a ledger's process still runs: one of a namespace no process is in any more is
    /// gone (its container ended); otherwise it must be there, with its start time.
    pub fn alive(&self, process: Process) -> bool {
        if process.pidns == 0 {
            return alive_here(process);
        }
        self.by_namespace
            .get(&(process.pidns, process.pid))
            .is_some_and(|(start, _)| process.start == 0 || *start == process.start)
    }

    /// The pid a ledger's process has in this process's namespace (what the driver reports, and
    /// what a signal from here reaches): its own for a row of this namespace, found through
    /// `NSpid` for one of another; `None` when it no longer runs.
    pub fn local_pid(&self, process: Process) -> Option<u32> {
        if process.pidns == 0 || Some(process.pidns) == own_pid_namespace() {
            return alive_here(process).then_some(process.pid);
        }
        self.by_namespace
            .get(&(process.pidns, process.pid))
            .filter(|(start, _)| process.start == 0 || *start == process.start)
            .map(|(_, here)| *here)
    }
}

fn alive_here(process: Process) -> bool {
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
            pidns: me.pidns,
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
                                pidns: 0,
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

    /// What the emulated driver reports of a container's process: its pid as the caller sees it.
    #[test]
    fn a_process_of_another_pid_namespace_is_found_by_its_pid_here() {
        // A process in a pid namespace of its own, as a container's: pid 1 there.
        let Ok(mut child) = std::process::Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc", "sleep", "30"])
            .spawn()
        else {
            println!("SKIPPED: no unshare here");
            return;
        };
        let inner = (0..100).find_map(|_| {
            std::thread::sleep(std::time::Duration::from_millis(50));
            let children =
                std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", child.id())).ok()?;
            children.split_whitespace().next()?.parse::<u32>().ok()
        });
        let found = inner.and_then(|host_pid| {
            let ns = pid_namespace(&host_pid.to_string())?;
            let recorded = Process {
                pid: 1,
                start: start_time(host_pid)?,
                pidns: ns,
            };
            Some((host_pid, HostProcesses::read().local_pid(recorded)))
        });
        let _ = child.kill();
        let _ = child.wait();
        match found {
            Some((host_pid, local)) => assert_eq!(local, Some(host_pid)),
            // Not allowed to make a pid namespace here (no root): nothing to check.
            None => println!("SKIPPED: cannot make a pid namespace here"),
        }
        let me = Process::current();
        assert_eq!(HostProcesses::read().local_pid(me), Some(me.pid));
    }

    /// The containers of a pod share a slice's ledger from different pid namespaces: neither
    /// reclaims the other's rows (their pids mean nothing to it), the same pid in two namespaces
    /// gets two rows, and the host's view frees the rows of a namespace that is gone.
    #[test]
    fn rows_of_another_pid_namespace_are_left_to_the_host() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::open(&dir.path().join("memory")).unwrap();
        let me = Process::current();
        let neighbour = Process {
            pid: me.pid,
            start: me.start,
            pidns: me.pidns.wrapping_add(1),
        };
        let mine = ledger.row_for(me, 0).unwrap();
        let theirs = ledger.row_for(neighbour, 0).unwrap();
        assert_ne!(mine, theirs, "one pid in two namespaces is two processes");
        assert!(ledger.try_charge(mine, 100, 1000));
        assert!(ledger.try_charge(theirs, 300, 1000));
        assert_eq!(ledger.reclaim(alive), 0, "not ours to judge");
        assert_eq!(ledger.used(0), 400);
        let host = HostProcesses::read();
        assert!(host.alive(me), "the host sees this process");
        assert_eq!(
            ledger.reclaim(|p| host.alive(p)),
            300,
            "no process is in the neighbour's namespace any more"
        );
        assert_eq!(ledger.used(0), 100);
    }

    #[test]
    fn a_ledger_is_never_opened_through_a_symbolic_link() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"").unwrap();
        let link = dir.path().join("memory");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(Ledger::open(&link).is_err());
        assert_eq!(std::fs::metadata(&target).unwrap().len(), 0, "not extended");
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
