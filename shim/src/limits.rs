//! Where a process's limits come from: the slice's config, written read-only by the node agent.
//!
//! - In a container given a software slice, the CDI spec bind-mounts the config read-only at
//!   [`paths::PINNED_CONFIG`] and names the shim in `/etc/ld.so.preload`. The pinned config is
//!   used whatever the environment says: unsetting or redirecting `GPUSLICE_SLICE_CONFIG` changes
//!   nothing. It must be on a read-only mount (root in the container cannot rewrite it).
//! - Elsewhere (`gpuslice run`), `GPUSLICE_SLICE_CONFIG` names `<state>/slices/<id>/config`; a
//!   config the process could have written itself (its own file, or a writable one or one in a
//!   writable directory) is refused.
//! - `GPUSLICE_MEMORY_LIMIT` lowers the cap, never raises it.
//!
//! A config that is named but cannot be used fails closed: allocations are refused and the reason
//! is printed once, rather than running without a cap. So does a process into which
//! `/etc/ld.so.preload` loads the shim while no config is there: that preload is what a slice's
//! container gets, so the shim is there to cap it.

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
    /// The config is the one the CDI spec pinned: this process is in a slice's container, whose
    /// slice an agent prepared (so an agent that cannot be reached is restarting, not absent).
    pub pinned: bool,
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
    LIMITS.get_or_init(|| {
        let (path, loaded) = match find_config() {
            Found::None => return Limits::Off,
            Found::PreloadedWithout => (
                PathBuf::from(paths::SYSTEM_PRELOAD),
                Err(format!(
                    "the shim is preloaded for a slice but there is no slice config at {}",
                    paths::PINNED_CONFIG
                )),
            ),
            Found::Pinned(path) => {
                let loaded = read_only_mount(&path).and_then(|()| load(&path, &pinned_state()));
                let loaded = loaded.map(|slice| Slice {
                    pinned: true,
                    ..slice
                });
                (path, loaded)
            }
            Found::Named(path) => {
                let loaded = named_state(&path).and_then(|state| load(&path, &state));
                (path, loaded)
            }
        };
        match loaded {
            Ok(slice) => Limits::Capped(slice),
            Err(reason) => {
                eprintln!(
                    "gpuslice: {}: {reason}; GPU memory allocations are refused (fail closed)",
                    path.display()
                );
                Limits::Closed
            }
        }
    })
}

/// Where this process's slice config is, if it has one.
enum Found {
    None,
    /// The CDI spec's read-only config.
    Pinned(PathBuf),
    /// The config `GPUSLICE_SLICE_CONFIG` names.
    Named(PathBuf),
    /// `/etc/ld.so.preload` loads the shim but no config is there.
    PreloadedWithout,
}

fn find_config() -> Found {
    let pinned = Path::new(paths::PINNED_CONFIG);
    // `symlink_metadata`: a pinned path that exists in any form is taken (and checked), so a
    // dangling link or an unreadable file fails closed rather than falling back to the env.
    if pinned.symlink_metadata().is_ok() {
        return Found::Pinned(pinned.to_path_buf());
    }
    if let Some(path) = std::env::var_os(CONFIG_VAR) {
        return Found::Named(PathBuf::from(path));
    }
    if preloaded_by_system(Path::new(paths::SYSTEM_PRELOAD)) {
        return Found::PreloadedWithout;
    }
    Found::None
}

/// Whether a preload file names the shim (by its file name: the path differs by runtime).
fn preloaded_by_system(preload: &Path) -> bool {
    std::fs::read_to_string(preload).is_ok_and(|text| {
        text.split_whitespace().any(|lib| {
            Path::new(lib)
                .file_name()
                .is_some_and(|n| n == "libgpuslice.so")
        })
    })
}

/// The node contract as a container sees it, beside the pinned config.
fn pinned_state() -> StateDir {
    StateDir::new(paths::DEFAULT)
}

fn named_state(path: &Path) -> Result<StateDir, String> {
    if !path.is_absolute() {
        return Err(format!("{CONFIG_VAR} must be an absolute path"));
    }
    trusted(path)?;
    StateDir::of_slice_config(path)
        .ok_or_else(|| format!("{CONFIG_VAR} must name a slice config, <state>/slices/<id>/config"))
}

/// Refuses a pinned config that is not on a read-only mount: only the runtime's bind mount
/// makes it one no process in the container can rewrite, root included.
fn read_only_mount(path: &Path) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| "the path has a NUL byte".to_string())?;
    // SAFETY: statvfs with a NUL-terminated path and a zeroed buffer it fills.
    let mut fs: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; both pointers are valid for the call.
    if unsafe { libc::statvfs(c.as_ptr(), &mut fs) } != 0 {
        return Err(format!(
            "cannot read the slice config: {}",
            std::io::Error::last_os_error()
        ));
    }
    if fs.f_flag & libc::ST_RDONLY == 0 {
        return Err(
            "the pinned slice config is not on a read-only mount, so the workload could rewrite it"
                .into(),
        );
    }
    Ok(())
}

fn load(path: &Path, state: &StateDir) -> Result<Slice, String> {
    let config = read_config(path)?;
    let mut cap = config.memory_bytes;
    if let Ok(text) = std::env::var(LIMIT_VAR) {
        match parse_bytes(&text) {
            Some(lower) => cap = cap.min(lower),
            None => eprintln!("gpuslice: {LIMIT_VAR}={text:?} is not a size (like 8Gi); ignored"),
        }
    }
    let ledger = Ledger::open(&state.slice_ledger(&config.id)).map_err(|e| e.to_string())?;
    ledger.reclaim(alive);
    let row = ledger
        .row_for(Process::current(), 0)
        .map_err(|e| e.to_string())?;
    Ok(Slice {
        agent_socket: (config.kind == SliceKind::Software).then(|| state.socket()),
        pinned: false,
        id: config.id,
        cap,
        ledger,
        row,
        held: Mutex::new(HashMap::new()),
    })
}

/// The slice config at `path`, whole: a file that is not one (cut short, a field missing, bytes
/// of anything else) is refused, so the caller fails closed.
fn read_config(path: &Path) -> Result<SliceConfig, String> {
    let text = std::fs::read(path).map_err(|e| format!("cannot read the slice config: {e}"))?;
    serde_json::from_slice(&text).map_err(|e| format!("not a slice config: {e}"))
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

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// Whatever bytes are where the config should be, the reader never panics and takes
        /// only a whole config: a real one cut anywhere is refused (the shim then fails closed).
        #[test]
        fn the_config_reader_takes_only_whole_configs(
            junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            cut in 0usize..120,
        ) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("config");
            std::fs::write(&path, &junk).unwrap();
            let read = read_config(&path);
            proptest::prop_assert_eq!(
                read.is_ok(),
                serde_json::from_slice::<SliceConfig>(&junk).is_ok()
            );
            let whole = br#"{"id":"gpu0-s1","kind":"software","gpu":0,"deviceUuid":"GPU-x","memoryBytes":8589934592,"computePercent":50}"#;
            std::fs::write(&path, &whole[..cut.min(whole.len() - 1)]).unwrap();
            proptest::prop_assert!(read_config(&path).is_err());
        }
    }

    #[test]
    fn a_preload_file_that_names_the_shim_means_a_slice_is_expected() {
        let dir = tempfile::tempdir().unwrap();
        let preload = dir.path().join("ld.so.preload");
        std::fs::write(&preload, "/run/gpuslice/lib/libgpuslice.so\n").unwrap();
        assert!(preloaded_by_system(&preload));
        std::fs::write(
            &preload,
            "/usr/lib/libjemalloc.so /opt/x/libgpuslice.so.bak\n",
        )
        .unwrap();
        assert!(!preloaded_by_system(&preload));
        assert!(!preloaded_by_system(&dir.path().join("absent")));
    }
}
