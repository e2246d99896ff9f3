//! Processes of the node as `/proc` shows them: who started whom, so the agent can tell which
//! claim a process belongs to from its socket's peer credentials.

/// The parent of a process, if it (still) exists.
pub fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces and parentheses itself.
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// A process and its ancestors, nearest first (init excluded).
pub fn ancestry(pid: u32) -> Vec<u32> {
    /// Deeper than any real process tree; stops a loop on a pid reused while we walk.
    const MAX_DEPTH: usize = 64;
    let mut chain = vec![pid];
    while let Some(parent) = chain.last().copied().and_then(parent_of) {
        if parent <= 1 || chain.contains(&parent) || chain.len() > MAX_DEPTH {
            break;
        }
        chain.push(parent);
    }
    chain
}

/// The UID of the pod whose container `pid` runs in, from its cgroup path: kubelet names pod
/// cgroups `pod<uid>` (cgroupfs) or `kubepods-<qos>-pod<uid with _ for ->.slice` (systemd).
pub fn pod_of(pid: u32) -> Option<String> {
    pod_in_cgroups(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?)
}

/// The pod UID in the text of a `/proc/<pid>/cgroup` file.
pub fn pod_in_cgroups(text: &str) -> Option<String> {
    text.lines()
        .filter_map(|line| line.rsplit(':').next())
        .flat_map(|path| path.split('/'))
        .find_map(|part| {
            let after = &part[part.rfind("pod")? + 3..];
            let uid = after
                .strip_suffix(".slice")
                .unwrap_or(after)
                .replace('_', "-");
            (uid.len() == 36 && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-'))
                .then_some(uid)
        })
}

/// Every process of the node that runs in one of these pods (by UID).
pub fn of_pods(uids: &[String]) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| pod_of(*pid).is_some_and(|uid| uids.contains(&uid)))
        .collect();
    pids.sort_unstable();
    pids
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_pods_uid_is_read_from_its_cgroup_path() {
        let uid = "1b4c7f9e-3d2a-4e8b-9c1d-5f6a7b8c9d0e";
        let cgroupfs = format!("12:memory:/kubepods/burstable/pod{uid}/0123abcd\n0::/\n");
        assert_eq!(super::pod_in_cgroups(&cgroupfs).as_deref(), Some(uid));
        let systemd = format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-ab.scope\n",
            uid.replace('-', "_")
        );
        assert_eq!(super::pod_in_cgroups(&systemd).as_deref(), Some(uid));
        assert_eq!(
            super::pod_in_cgroups("0::/user.slice/session-3.scope\n"),
            None
        );
    }

    #[test]
    fn this_process_descends_from_its_parent() {
        let me = std::process::id();
        let parent = super::parent_of(me).expect("a parent");
        let chain = super::ancestry(me);
        assert_eq!(chain[0], me);
        if parent > 1 {
            assert_eq!(chain[1], parent);
        }
    }
}
