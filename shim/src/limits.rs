//! Where a process's limits come from: the slice's config, written read-only by the node agent
//! (`<state>/slices/<id>/config`) and named by `GPUSLICE_SLICE_CONFIG`. The environment can point
//! at a config and lower the cap (`GPUSLICE_MEMORY_LIMIT`), never raise it: a config the process
//! could have written itself (its own file, or a writable one or one in a writable directory) is
//! refused. A config that is named but cannot be used fails closed: allocations are refused and
//! the reason is printed once, rather than running without a cap.
//!
//! Root in the container can change anything, so root's configs are taken as they are; the
//! threat model (docs/contracts.md) says MIG is the answer where that matters.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use gpuslice_contract::env::{MEMORY_LIMIT as LIMIT_VAR, SLICE_CONFIG as CONFIG_VAR};
use gpuslice_contract::{SliceConfig, SliceKind, StateDir, paths};
use gpuslice_shm::{Ledger, Process, RowId, alive};

/// What an allocation holds, by kind, so pointers and handles never collide.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Pointer,
    Physical,
    Array,
    Context,
}

/// A slice this process is capped to.
pub struct Slice {
    pub id: String,
    pub cap: u64,
    /// The node agent's socket, for a software slice's compute share.
    pub agent_socket: Option<PathBuf>,
    ledger: Ledger,
    row: RowId,
    held: Mutex<HashMap<(Kind, u64), u64>>,
}

/// The process's limits.
pub enum Limits {
    /// No slice config named: the shim passes everything through.
    Off,
    /// A config was named but cannot be used: allocations are refused.
    Closed,
    Capped(Slice),
}

static LIMITS: OnceLock<Limits> = OnceLock::new();

/// The limits, read on first use.
pub fn limits() -> &'static Limits {
    LIMITS.get_or_init(|| match std::env::var_os(CONFIG_VAR) {
        None => Limits::Off,
        Some(path) => match load(Path::new(&path)) {
            Ok(slice) => Limits::Capped(slice),
            Err(reason) => {
                eprintln!(
                    "gpuslice: {}: {reason}; GPU memory allocations are refused (fail closed)",
                    Path::new(&path).display()
                );
                Limits::Closed
            }
        },
    })
}

fn load(path: &Path) -> Result<Slice, String> {
    if !path.is_absolute() {
        return Err(format!("{CONFIG_VAR} must be an absolute path"));
    }
    trusted(path)?;
    let text = std::fs::read(path).map_err(|e| format!("cannot read the slice config: {e}"))?;
    let config: SliceConfig =
        serde_json::from_slice(&text).map_err(|e| format!("not a slice config: {e}"))?;
    let mut cap = config.memory_bytes;
    if let Ok(text) = std::env::var(LIMIT_VAR) {
        match parse_bytes(&text) {
            Some(lower) => cap = cap.min(lower),
            None => eprintln!("gpuslice: {LIMIT_VAR}={text:?} is not a size (like 8Gi); ignored"),
        }
    }
    let ledger = Ledger::open(&paths::ledger_beside(path)).map_err(|e| e.to_string())?;
    ledger.reclaim(alive);
    let row = ledger
        .row_for(Process::current(), 0)
        .map_err(|e| e.to_string())?;
    Ok(Slice {
        agent_socket: (config.kind == SliceKind::Software)
            .then(|| StateDir::of_slice_config(path).map(|s| s.socket()))
            .flatten(),
        id: config.id,
        cap,
        ledger,
        row,
        held: Mutex::new(HashMap::new()),
    })
}

/// Refuses a config this process could have written or replaced.
fn trusted(path: &Path) -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if euid == 0 {
        return Ok(());
    }
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read the slice config: {e}"))?;
    if meta.uid() == euid {
        return Err("the slice config belongs to this process's user, so it could have raised its own limits".into());
    }
    if writable(path) {
        return Err("the slice config is writable by this process".into());
    }
    if path.parent().is_some_and(writable) {
        return Err("the slice config's directory is writable by this process, so the config could be replaced".into());
    }
    Ok(())
}

fn writable(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt as _;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: access with a NUL-terminated path.
    unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
}

/// `20Gi`, `512Mi`, `1G`, `1048576`.
pub fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().ok()?;
    let factor: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "K" | "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    n.checked_mul(factor)
}

impl Slice {
    /// Bytes held on the slice by all its processes.
    pub fn used(&self) -> u64 {
        self.ledger.used(0)
    }

    /// Takes `bytes` if the slice stays within its cap; memory of dead processes comes back first
    /// when it would not.
    pub fn try_charge(&self, bytes: u64) -> bool {
        let taken = self.ledger.try_charge(self.row, bytes, self.cap)
            || (self.ledger.reclaim(alive) > 0
                && self.ledger.try_charge(self.row, bytes, self.cap));
        if !taken {
            self.ledger.count_refusal();
        }
        taken
    }

    /// Takes `bytes` whatever the cap (what the driver took on its own).
    pub fn charge(&self, bytes: u64) {
        self.ledger.charge(self.row, bytes);
    }

    pub fn release(&self, bytes: u64) {
        self.ledger.release(self.row, bytes);
    }

    /// Bytes this process holds in the ledger.
    pub fn held_by_me(&self) -> u64 {
        self.ledger.held(self.row)
    }

    pub fn remember(&self, kind: Kind, key: u64, bytes: u64) {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((kind, key), bytes);
    }

    pub fn forget(&self, kind: Kind, key: u64) -> Option<u64> {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(kind, key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_kubernetes_writes_them() {
        assert_eq!(parse_bytes("20Gi"), Some(20 << 30));
        assert_eq!(parse_bytes("512Mi"), Some(512 << 20));
        assert_eq!(parse_bytes("1G"), Some(1_000_000_000));
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("99999999999999999999Gi"), None);
    }
}
