//! The machine's state in a file shared by every process that opens it (NVML emulator, CUDA
//! emulator, agent, tests), so a restarted process sees what an earlier one created, as with real
//! hardware. Each transaction holds an exclusive lock on a sidecar lock file, reads the state,
//! applies the change and replaces the file atomically.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::PermissionsExt as _;

/// The state and its lock file are for every user, as a driver's device nodes (`/dev/nvidia*`,
/// mode 0666) are: a workload of any user in a container reaches the emulated GPUs.
const SHARED: u32 = 0o666;
use std::path::{Path, PathBuf};

use crate::model::{Machine, Mutation, NvmlError};

/// Why the state file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not an emulator state file: {source}")]
    Corrupt {
        path: String,
        source: serde_json::Error,
    },
}

/// A handle on a state file.
#[derive(Clone, Debug)]
pub struct Store {
    path: PathBuf,
}

impl Store {
    /// Creates (or replaces) the state file with a machine.
    pub fn create(path: &Path, machine: &Machine) -> Result<Store, StoreError> {
        let store = Store {
            path: path.to_path_buf(),
        };
        let _lock = store.lock()?;
        store.write(machine)?;
        Ok(store)
    }

    /// Opens an existing state file.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let store = Store {
            path: path.to_path_buf(),
        };
        store.read()?;
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io(&self, source: std::io::Error) -> StoreError {
        StoreError::Io {
            path: self.path.display().to_string(),
            source,
        }
    }

    fn lock(&self) -> Result<File, StoreError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let lock_path = self.path.with_extension("lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(SHARED)
            .open(&lock_path)
            .map_err(|e| self.io(e))?;
        // The umask took from the mode; the file's owner gives it back (others cannot, nor need).
        let _ = file.set_permissions(std::fs::Permissions::from_mode(SHARED));
        file.lock().map_err(|e| self.io(e))?;
        Ok(file)
    }

    fn read(&self) -> Result<Machine, StoreError> {
        let text = std::fs::read(&self.path).map_err(|e| self.io(e))?;
        let mut machine: Machine =
            serde_json::from_slice(&text).map_err(|source| StoreError::Corrupt {
                path: self.path.display().to_string(),
                source,
            })?;
        machine.reap(process_alive);
        Ok(machine)
    }

    fn write(&self, machine: &Machine) -> Result<(), StoreError> {
        let dir = self
            .path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let tmp = tempfile::NamedTempFile::new_in(dir).map_err(|e| self.io(e))?;
        serde_json::to_writer(&tmp, machine).map_err(|e| self.io(e.into()))?;
        // Whatever the umask: every user of the machine reaches the emulated driver.
        tmp.as_file()
            .set_permissions(std::fs::Permissions::from_mode(SHARED))
            .map_err(|e| self.io(e))?;
        tmp.as_file().sync_all().map_err(|e| self.io(e))?;
        tmp.persist(&self.path).map_err(|e| self.io(e.error))?;
        Ok(())
    }

    /// A consistent snapshot of the machine.
    pub fn snapshot(&self) -> Result<Machine, StoreError> {
        let _lock = self.lock()?;
        self.read()
    }

    /// Changes the machine without fault injection (test setup, processes coming and going).
    pub fn update<T>(&self, change: impl FnOnce(&mut Machine) -> T) -> Result<T, StoreError> {
        let _lock = self.lock()?;
        let mut machine = self.read()?;
        let out = change(&mut machine);
        self.write(&machine)?;
        Ok(out)
    }

    /// Runs one mutating NVML call under fault injection. A `Kill*` fault saves the state as the
    /// fault says (with or without the call's effect) and aborts the process, as a crash would.
    pub fn mutate<T>(
        &self,
        call: impl FnOnce(&mut Machine) -> Result<T, NvmlError>,
    ) -> Result<Result<T, NvmlError>, StoreError> {
        let _lock = self.lock()?;
        let mut machine = self.read()?;
        match machine.mutate(call) {
            Mutation::Done(result) => {
                self.write(&machine)?;
                Ok(result)
            }
            Mutation::Die { .. } => {
                self.write(&machine)?;
                std::process::abort();
            }
        }
    }
}

/// Whether a process runs (a zombie that has exited but not been waited for does not).
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may hold spaces.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::FaultAction;
    use gpuslice_api::NodeInventory;

    fn machine() -> Machine {
        let node: NodeInventory =
            serde_yaml::from_str("name: n\ngpus:\n- {index: 0, model: NVIDIA H200}\n").unwrap();
        Machine::from_inventory(&node).unwrap()
    }

    #[test]
    fn state_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let store = Store::create(&path, &machine()).unwrap();
        store.mutate(|m| m.set_mig_mode(0, true)).unwrap().unwrap();
        let id = store
            .mutate(|m| m.create_gpu_instance(0, 9, Some(4)))
            .unwrap()
            .unwrap();
        let reopened = Store::open(&path).unwrap().snapshot().unwrap();
        assert!(reopened.gpu(0).unwrap().mig_enabled);
        assert_eq!(reopened.gpu(0).unwrap().instances[0].id, id);
        assert_eq!(reopened.mutations, 2);
    }

    #[test]
    fn concurrent_writers_lose_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        Store::create(&path, &machine()).unwrap();
        let workers: Vec<_> = (0..8u32)
            .map(|w| {
                let path = path.clone();
                std::thread::spawn(move || {
                    // Each worker opens its own handle, as separate processes would.
                    let store = Store::open(&path).unwrap();
                    for i in 0..20 {
                        store
                            .update(|m| m.attach_process(0, w * 100 + i, 1 << 20, None))
                            .unwrap()
                            .unwrap();
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        let m = Store::open(&path).unwrap().snapshot().unwrap();
        assert_eq!(m.gpu(0).unwrap().processes.len(), 160);
    }

    /// Re-runs this test binary as the "agent" that gets killed, then checks what it left behind.
    #[test]
    fn kill_faults_abort_the_caller_and_keep_or_drop_the_call() {
        const CHILD: &str = "GPUSLICE_EMULATOR_KILL_CHILD";
        if let Some(path) = std::env::var_os(CHILD) {
            let store = Store::open(Path::new(&path)).unwrap();
            store.mutate(|m| m.set_mig_mode(0, true)).unwrap().unwrap();
            store
                .mutate(|m| m.create_gpu_instance(0, 0, Some(0)))
                .unwrap()
                .unwrap();
            unreachable!("the second mutation is armed to kill this process");
        }
        for (action, applied) in [
            (FaultAction::KillBefore, false),
            (FaultAction::KillAfter, true),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("state.json");
            let mut m = machine();
            m.faults.push(crate::model::Fault {
                at: 2,
                action: action.clone(),
            });
            Store::create(&path, &m).unwrap();
            let status = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "store::tests::kill_faults_abort_the_caller_and_keep_or_drop_the_call",
                    "--nocapture",
                ])
                .env(CHILD, &path)
                .stderr(std::process::Stdio::null())
                .status()
                .unwrap();
            assert!(!status.success(), "{action:?}: the child must die");
            let after = Store::open(&path).unwrap().snapshot().unwrap();
            assert_eq!(after.mutations, 2, "{action:?}");
            assert_eq!(
                after.gpu(0).unwrap().instances.len(),
                usize::from(applied),
                "{action:?}"
            );
        }
    }

    #[test]
    fn a_real_process_leaves_the_gpu_when_it_exits() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::create(&dir.path().join("state.json"), &machine()).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        store
            .update(|m| m.attach_real_process(0, child.id(), 1 << 30, None))
            .unwrap()
            .unwrap();
        store
            .update(|m| m.attach_process(0, 999_999_999, 1 << 20, None))
            .unwrap()
            .unwrap();
        let pids = |s: &Store| -> Vec<u32> {
            let m = s.snapshot().unwrap();
            m.gpu(0).unwrap().processes.iter().map(|p| p.pid).collect()
        };
        assert_eq!(pids(&store), vec![child.id(), 999_999_999]);
        child.kill().unwrap();
        // Not yet waited for: a zombie has exited all the same.
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(pids(&store), vec![999_999_999], "seeded processes stay");
        child.wait().unwrap();
    }

    #[test]
    fn a_corrupt_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        std::fs::write(&path, "not json").unwrap();
        let err = Store::open(&path).unwrap_err();
        assert!(
            err.to_string()
                .contains("state.json: not an emulator state file"),
            "{err}"
        );
    }
}
