//! Host CPU and memory per slice (`GpuSlicePolicy.spec.host`) for `gpuslice run` commands: the
//! agent puts the `gpuslice run` process in `gpuslice/<node>/<slice>` of the cpu, cpuset and
//! memory controllers (cgroup v1 hierarchies, or the v2 unified one) before it grants the slice,
//! so the command it starts is born there. CPU time is capped by CFS quota; a whole number of
//! cores also gets cores of its own (a cpuset no other slice's command of the node holds, when
//! enough are free); memory is a hard limit. (In a cluster the policy's CPU and memory become the
//! pod's requests at admission instead, and the kubelet enforces them.)

use std::path::{Path, PathBuf};

/// The group of `gpuslice run` workloads, under each controller's root.
const RUN_GROUP: &str = "gpuslice";
/// The CFS period quotas are expressed in (the kernel's default, 100 ms).
const PERIOD_US: u64 = 100_000;

/// Why a limit cannot be applied.
#[derive(Debug, thiserror::Error)]
pub enum HostLimitError {
    #[error(
        "no cgroup {what} controller under {root}; mount one, or remove the policy's spec.host"
    )]
    NoController { what: &'static str, root: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> HostLimitError + '_ {
    move |source| HostLimitError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn read(path: &Path) -> Result<String, HostLimitError> {
    std::fs::read_to_string(path)
        .map(|t| t.trim().to_string())
        .map_err(io(path))
}

fn write(path: &Path, value: &str) -> Result<(), HostLimitError> {
    std::fs::write(path, value).map_err(io(path))
}

/// What a slice's command may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostLimit {
    pub millicores: Option<u64>,
    pub memory_bytes: Option<u64>,
}

/// A CPU list as the kernel writes it (`0-3,8,10-11`).
pub fn parse_cpus(text: &str) -> Vec<u32> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                    cpus.extend(a..=b);
                }
            }
            None => cpus.extend(part.parse::<u32>().ok()),
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    cpus
}

fn format_cpus(cpus: &[u32]) -> String {
    cpus.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The node's cpu, cpuset and memory controllers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostCgroups {
    /// cgroup v1: the roots of the cpu, cpuset and memory hierarchies.
    V1 {
        cpu: PathBuf,
        cpuset: PathBuf,
        memory: PathBuf,
    },
    /// cgroup v2: the unified root, with cpu, cpuset and memory available.
    V2(PathBuf),
}

impl HostCgroups {
    pub fn detect(root: &Path) -> Result<HostCgroups, HostLimitError> {
        let v1 = |name: &str| Some(root.join(name)).filter(|p| p.join("cgroup.procs").exists());
        if let (Some(cpu), Some(cpuset), Some(memory)) = (v1("cpu"), v1("cpuset"), v1("memory")) {
            return Ok(HostCgroups::V1 {
                cpu,
                cpuset,
                memory,
            });
        }
        let controllers =
            std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
        let missing = ["cpu", "cpuset", "memory"]
            .into_iter()
            .find(|c| !controllers.split_whitespace().any(|have| have == *c));
        match missing {
            None => Ok(HostCgroups::V2(root.to_path_buf())),
            Some(what) => Err(HostLimitError::NoController {
                what,
                root: root.display().to_string(),
            }),
        }
    }

    /// Limits `gpuslice run` process `pid` on `slice` of `node` to `limit`. `others` are the
    /// slices of the node other commands hold now (their cores are not given again).
    pub fn confine(
        &self,
        node: &str,
        slice: &str,
        pid: u32,
        limit: HostLimit,
        others: &[String],
    ) -> Result<(), HostLimitError> {
        match self {
            HostCgroups::V1 {
                cpu,
                cpuset,
                memory,
            } => {
                if let Some(millicores) = limit.millicores {
                    let group = group_v1(cpu, node, slice, |_| Ok(()))?;
                    write(&group.join("cpu.cfs_period_us"), &PERIOD_US.to_string())?;
                    write(
                        &group.join("cpu.cfs_quota_us"),
                        &(millicores.saturating_mul(PERIOD_US) / 1000).to_string(),
                    )?;
                    write(&group.join("cgroup.procs"), &pid.to_string())?;
                    if millicores.is_multiple_of(1000) {
                        // A new v1 cpuset group has no cpus or mems until given its parent's.
                        let inherit = |dir: &Path| -> Result<(), HostLimitError> {
                            let parent = dir.parent().unwrap_or(dir);
                            for file in ["cpuset.cpus", "cpuset.mems"] {
                                if read(&dir.join(file))?.is_empty() {
                                    write(&dir.join(file), &read(&parent.join(file))?)?;
                                }
                            }
                            Ok(())
                        };
                        let group = group_v1(cpuset, node, slice, inherit)?;
                        let node_dir = group.parent().unwrap_or(&group).to_path_buf();
                        if let Some(cores) =
                            free_cores(&node_dir, slice, others, millicores / 1000, "cpuset.cpus")?
                        {
                            write(&group.join("cpuset.cpus"), &format_cpus(&cores))?;
                            write(&group.join("cgroup.procs"), &pid.to_string())?;
                        }
                    }
                }
                if let Some(bytes) = limit.memory_bytes {
                    let group = group_v1(memory, node, slice, |_| Ok(()))?;
                    write(&group.join("memory.limit_in_bytes"), &bytes.to_string())?;
                    write(&group.join("cgroup.procs"), &pid.to_string())?;
                }
                Ok(())
            }
            HostCgroups::V2(root) => {
                let group = group_v2(root, node, slice)?;
                if let Some(millicores) = limit.millicores {
                    write(
                        &group.join("cpu.max"),
                        &format!(
                            "{} {PERIOD_US}",
                            millicores.saturating_mul(PERIOD_US) / 1000
                        ),
                    )?;
                    if millicores.is_multiple_of(1000) {
                        let node_dir = group.parent().unwrap_or(&group).to_path_buf();
                        if let Some(cores) = free_cores(
                            &node_dir,
                            slice,
                            others,
                            millicores / 1000,
                            "cpuset.cpus.effective",
                        )? {
                            write(&group.join("cpuset.cpus"), &format_cpus(&cores))?;
                        }
                    }
                }
                if let Some(bytes) = limit.memory_bytes {
                    write(&group.join("memory.max"), &bytes.to_string())?;
                }
                write(&group.join("cgroup.procs"), &pid.to_string())
            }
        }
    }

    /// Removes the groups of `node`'s slices not in `held` (a group still in use stays).
    pub fn remove_except(&self, node: &str, held: &[String]) {
        let roots: Vec<&Path> = match self {
            HostCgroups::V1 {
                cpu,
                cpuset,
                memory,
            } => vec![cpu, cpuset, memory],
            HostCgroups::V2(root) => vec![root],
        };
        for root in roots {
            let Ok(entries) = std::fs::read_dir(root.join(RUN_GROUP).join(node)) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if entry.path().is_dir() && !held.contains(&name) {
                    let _ = std::fs::remove_dir(entry.path());
                }
            }
        }
    }
}

/// `<hierarchy>/gpuslice/<node>/<slice>`, made if needed; `prepare` readies each new level.
fn group_v1(
    hierarchy: &Path,
    node: &str,
    slice: &str,
    prepare: impl Fn(&Path) -> Result<(), HostLimitError>,
) -> Result<PathBuf, HostLimitError> {
    let mut dir = hierarchy.to_path_buf();
    for part in [RUN_GROUP, node, slice] {
        dir = dir.join(part);
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        prepare(&dir)?;
    }
    Ok(dir)
}

/// The v2 group, with cpu, cpuset and memory enabled down to it.
fn group_v2(root: &Path, node: &str, slice: &str) -> Result<PathBuf, HostLimitError> {
    let mut dir = root.to_path_buf();
    for part in [RUN_GROUP, node, slice] {
        let control = dir.join("cgroup.subtree_control");
        let enabled = read(&control)?;
        for controller in ["cpu", "cpuset", "memory"] {
            if !enabled.split_whitespace().any(|c| c == controller) {
                write(&control, &format!("+{controller}"))?;
            }
        }
        dir = dir.join(part);
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    }
    Ok(dir)
}

/// `count` cores of the node's (its group's `cpus_file`) that no other held slice's group has,
/// lowest first; `None` when fewer are free (the quota still caps the command).
fn free_cores(
    node_dir: &Path,
    slice: &str,
    others: &[String],
    count: u64,
    cpus_file: &str,
) -> Result<Option<Vec<u32>>, HostLimitError> {
    let all = parse_cpus(&read(&node_dir.join(cpus_file))?);
    let taken: Vec<u32> = others
        .iter()
        .filter(|other| other.as_str() != slice)
        .flat_map(|other| {
            std::fs::read_to_string(node_dir.join(other).join("cpuset.cpus"))
                .map(|t| parse_cpus(&t))
                .unwrap_or_default()
        })
        .collect();
    let free: Vec<u32> = all.into_iter().filter(|c| !taken.contains(c)).collect();
    let count = usize::try_from(count).unwrap_or(usize::MAX);
    if free.len() < count {
        tracing::warn!(
            "slice {slice}: {count} cores asked, {} free: CPU time is capped, no cores of its own",
            free.len()
        );
        return Ok(None);
    }
    Ok(Some(free[..count].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_read_as_the_kernel_writes_them() {
        assert_eq!(parse_cpus("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpus(""), Vec::<u32>::new());
        assert_eq!(format_cpus(&[0, 1, 5]), "0,1,5");
    }

    #[test]
    fn a_node_without_the_controllers_is_an_error_that_says_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        let e = HostCgroups::detect(dir.path()).unwrap_err();
        assert!(
            e.to_string().contains("remove the policy's spec.host"),
            "{e}"
        );
    }

    #[test]
    fn whole_cores_go_to_one_slice_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path();
        std::fs::write(node.join("cpuset.cpus"), "0-3\n").unwrap();
        std::fs::create_dir_all(node.join("gpu0-s0")).unwrap();
        std::fs::write(node.join("gpu0-s0/cpuset.cpus"), "0-1\n").unwrap();
        let others = vec!["gpu0-s0".to_string()];
        let got = free_cores(node, "gpu0-s1", &others, 2, "cpuset.cpus").unwrap();
        assert_eq!(got, Some(vec![2, 3]));
        assert_eq!(
            free_cores(node, "gpu0-s1", &others, 3, "cpuset.cpus").unwrap(),
            None,
            "not enough free: quota only"
        );
    }
}
