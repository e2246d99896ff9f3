//! Block I/O bandwidth per slice (`GpuPool.spec.io.bandwidthPerSlice`): the workload of a slice
//! reads and writes each local disk of the node at most that fast. The limit goes on a cgroup —
//! cgroup v1 `blkio.throttle.{read,write}_bps_device`, or cgroup v2 `io.max`, whichever the node
//! has — that holds the workload: the pod's cgroup (found by the pod UID of the claim) or one the
//! agent makes for a `gpuslice run` (`gpuslice/<slice>`), into which it moves the `gpuslice run`
//! process before granting the slice, so the command it starts is born there.

use std::path::{Path, PathBuf};

/// The group of `gpuslice run` workloads, under the controller's root.
const RUN_GROUP: &str = "gpuslice";
/// How deep a pod's cgroup may be below the root (`kubepods.slice/kubepods-burstable.slice/
/// kubepods-burstable-pod<uid>.slice` is 3).
const POD_DEPTH: usize = 4;

/// Why a limit cannot be applied.
#[derive(Debug, thiserror::Error)]
pub enum IoLimitError {
    #[error(
        "no cgroup I/O controller under {root}: neither cgroup v1 blkio (blkio.throttle.read_bps_device) nor cgroup v2 io (cgroup.controllers); mount one, or remove spec.io.bandwidthPerSlice"
    )]
    NoController { root: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> IoLimitError + '_ {
    move |source| IoLimitError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A pool's I/O limit per slice (`io.bandwidthPerSlice`), bytes per second.
pub fn bandwidth_of(pool: &gpuslice_api::GpuPoolSpec) -> Option<u64> {
    let limit = pool.io.as_ref()?.bandwidth_per_slice.as_ref()?;
    gpuslice_api::bytes_of(&limit.0).ok()
}

/// A block device, `major:minor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Disk {
    pub major: u32,
    pub minor: u32,
}

impl std::fmt::Display for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

/// The node's local disks (`/sys/block`, without loop, RAM, zram, optical and floppy devices):
/// what a workload's data lives on.
pub fn local_disks(sys_block: &Path) -> Vec<Disk> {
    const VIRTUAL: [&str; 5] = ["loop", "ram", "zram", "sr", "fd"];
    let Ok(entries) = std::fs::read_dir(sys_block) else {
        return Vec::new();
    };
    let mut disks: Vec<Disk> = entries
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            !VIRTUAL.iter().any(|v| name.starts_with(v))
        })
        .filter_map(|e| {
            let text = std::fs::read_to_string(e.path().join("dev")).ok()?;
            let (major, minor) = text.trim().split_once(':')?;
            Some(Disk {
                major: major.parse().ok()?,
                minor: minor.parse().ok()?,
            })
        })
        .collect();
    disks.sort();
    disks
}

/// Which controller the node has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Controller {
    /// cgroup v1: the blkio hierarchy's root.
    V1(PathBuf),
    /// cgroup v2: the unified hierarchy's root, with `io` available.
    V2(PathBuf),
}

/// The node's I/O controller and disks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cgroups {
    pub controller: Controller,
    pub disks: Vec<Disk>,
}

impl Cgroups {
    /// Finds the controller under `root` (`/sys/fs/cgroup`): v1 blkio first (on a hybrid node
    /// the unified hierarchy has no io), else v2.
    pub fn detect(root: &Path, sys_block: &Path) -> Result<Cgroups, IoLimitError> {
        let blkio = root.join("blkio");
        let controller = if blkio.join("blkio.throttle.read_bps_device").exists() {
            Controller::V1(blkio)
        } else if std::fs::read_to_string(root.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "io"))
        {
            Controller::V2(root.to_path_buf())
        } else {
            return Err(IoLimitError::NoController {
                root: root.display().to_string(),
            });
        };
        Ok(Cgroups {
            controller,
            disks: local_disks(sys_block),
        })
    }

    fn root(&self) -> &Path {
        match &self.controller {
            Controller::V1(root) | Controller::V2(root) => root,
        }
    }

    /// `v1 blkio` or `v2 io`, for messages.
    pub fn kind(&self) -> &'static str {
        match self.controller {
            Controller::V1(_) => "cgroup v1 blkio",
            Controller::V2(_) => "cgroup v2 io",
        }
    }

    /// Limits the cgroup `group` to `bytes_per_second` read and write on each disk (0: no
    /// limit). Writes only what differs, so a pass that changes nothing writes nothing.
    pub fn limit(&self, group: &Path, bytes_per_second: u64) -> Result<(), IoLimitError> {
        match &self.controller {
            Controller::V1(_) => {
                for file in [
                    "blkio.throttle.read_bps_device",
                    "blkio.throttle.write_bps_device",
                ] {
                    let path = group.join(file);
                    let now = std::fs::read_to_string(&path).map_err(io(&path))?;
                    for disk in &self.disks {
                        let current = now.lines().find_map(|l| {
                            let (d, v) = l.split_once(' ')?;
                            (d == disk.to_string()).then(|| v.trim().parse::<u64>().ok())?
                        });
                        if current.unwrap_or(0) != bytes_per_second {
                            std::fs::write(&path, format!("{disk} {bytes_per_second}"))
                                .map_err(io(&path))?;
                        }
                    }
                }
            }
            Controller::V2(_) => {
                let path = group.join("io.max");
                let now = std::fs::read_to_string(&path).map_err(io(&path))?;
                let value = if bytes_per_second == 0 {
                    "max".to_string()
                } else {
                    bytes_per_second.to_string()
                };
                for disk in &self.disks {
                    let want = format!("{disk} rbps={value} wbps={value}");
                    let has = now
                        .lines()
                        .find(|l| l.starts_with(&format!("{disk} ")))
                        .is_some_and(|l| {
                            l.contains(&format!("rbps={value}"))
                                && l.contains(&format!("wbps={value}"))
                        });
                    // No line for a disk means no limit: nothing to clear.
                    let listed = now.contains(&format!("{disk} "));
                    if !has && (bytes_per_second != 0 || listed) {
                        std::fs::write(&path, want).map_err(io(&path))?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The cgroup of `gpuslice run` workloads on `slice` of `node`, made if needed (on cgroup v2
    /// with the io controller enabled down to it).
    pub fn run_group(&self, node: &str, slice: &str) -> Result<PathBuf, IoLimitError> {
        let root = self.root();
        let parents = [root.join(RUN_GROUP), root.join(RUN_GROUP).join(node)];
        for dir in &parents {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        if let Controller::V2(_) = &self.controller {
            for dir in std::iter::once(root).chain(parents.iter().map(PathBuf::as_path)) {
                let control = dir.join("cgroup.subtree_control");
                let enabled = std::fs::read_to_string(&control).map_err(io(&control))?;
                if !enabled.split_whitespace().any(|c| c == "io") {
                    std::fs::write(&control, "+io").map_err(io(&control))?;
                }
            }
        }
        let group = parents[1].join(slice);
        std::fs::create_dir_all(&group).map_err(io(&group))?;
        Ok(group)
    }

    /// Moves process `pid` into `group` (its children to come are born there).
    pub fn enter(&self, group: &Path, pid: u32) -> Result<(), IoLimitError> {
        let procs = group.join("cgroup.procs");
        std::fs::write(&procs, pid.to_string()).map_err(io(&procs))
    }

    /// Removes the `gpuslice run` groups of `node`'s slices not in `held` (their workloads are
    /// gone; a group still in use cannot be removed and stays).
    pub fn remove_run_groups_except(&self, node: &str, held: &[String]) {
        let Ok(entries) = std::fs::read_dir(self.root().join(RUN_GROUP).join(node)) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if entry.path().is_dir() && !held.contains(&name) {
                let _ = std::fs::remove_dir(entry.path());
            }
        }
    }

    /// The cgroups of a pod (by UID) and of its containers below it: kubelet names a pod's
    /// cgroup `pod<uid>` (cgroupfs driver) or `kubepods-<qos>-pod<uid, _ for ->.slice`
    /// (systemd driver).
    pub fn pod_groups(&self, uid: &str) -> Vec<PathBuf> {
        let names = [
            format!("pod{uid}"),
            format!("pod{}.slice", uid.replace('-', "_")),
        ];
        let is_pod = |dir: &Path| {
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .is_some_and(|n| names.iter().any(|want| n.ends_with(want.as_str())))
        };
        let mut found = Vec::new();
        let mut level = vec![self.root().to_path_buf()];
        for _ in 0..POD_DEPTH {
            let mut next = Vec::new();
            for dir in &level {
                for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                    let path = entry.path();
                    if !path.is_dir() {
                        continue;
                    }
                    if is_pod(&path) {
                        found.push(path.clone());
                        found.extend(
                            std::fs::read_dir(&path)
                                .into_iter()
                                .flatten()
                                .flatten()
                                .map(|e| e.path())
                                .filter(|p| p.is_dir()),
                        );
                    } else {
                        next.push(path);
                    }
                }
            }
            level = next;
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_v1() -> (tempfile::TempDir, Cgroups) {
        let dir = tempfile::tempdir().unwrap();
        let blkio = dir.path().join("cgroup/blkio");
        let pod = blkio.join("kubepods/burstable/pod1b4e28ba-2fa1-11d2-883f-0016d3cca427");
        std::fs::create_dir_all(pod.join("c1")).unwrap();
        for group in [blkio.clone(), pod.clone(), pod.join("c1")] {
            for file in [
                "blkio.throttle.read_bps_device",
                "blkio.throttle.write_bps_device",
            ] {
                std::fs::write(group.join(file), "").unwrap();
            }
        }
        let block = dir.path().join("block");
        for (name, dev) in [("vda", "254:0"), ("loop0", "7:0"), ("nvme0n1", "259:0")] {
            std::fs::create_dir_all(block.join(name)).unwrap();
            std::fs::write(block.join(name).join("dev"), format!("{dev}\n")).unwrap();
        }
        let cgroups = Cgroups::detect(&dir.path().join("cgroup"), &block).unwrap();
        (dir, cgroups)
    }

    #[test]
    fn the_local_disks_are_found_and_a_pods_groups_limited() {
        let (_dir, cgroups) = fake_v1();
        assert!(matches!(cgroups.controller, Controller::V1(_)));
        assert_eq!(
            cgroups
                .disks
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["254:0", "259:0"],
            "loop devices hold no data of their own"
        );
        let groups = cgroups.pod_groups("1b4e28ba-2fa1-11d2-883f-0016d3cca427");
        assert_eq!(groups.len(), 2, "the pod and its container: {groups:?}");
        for group in &groups {
            cgroups.limit(group, 500 << 20).unwrap();
        }
        // A fake file keeps only the last write, as the kernel keeps one line per device.
        let written =
            std::fs::read_to_string(groups[0].join("blkio.throttle.read_bps_device")).unwrap();
        assert_eq!(written, "259:0 524288000");
        assert!(
            cgroups
                .pod_groups("00000000-0000-0000-0000-000000000000")
                .is_empty()
        );
    }

    #[test]
    fn no_controller_is_an_error_that_says_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let e = Cgroups::detect(dir.path(), dir.path()).unwrap_err();
        assert!(
            e.to_string().contains("remove spec.io.bandwidthPerSlice"),
            "{e}"
        );
    }
}
