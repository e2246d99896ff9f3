//! `gpuslice run` against a running agent on an emulated node: a slice is granted with the
//! shim and the slice's device and config in the environment, a claimed slice is busy (the agent
//! will not re-slice under it), later callers wait in line or are refused with --no-wait, and a
//! slice comes back when its command ends.

use std::io::BufRead as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gpuslice");

fn pool(slices: u32, memory: &str) -> String {
    format!(
        "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {{name: lab}}\nspec:\n  nodeSelector: {{matchLabels: {{lab: \"yes\"}}}}\n  layout:\n    software: {{slices: {slices}, memory: {memory}, compute: {}}}\n  memoryHeadroom: 1Gi\n---\napiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {{name: small}}\nspec:\n  pool: lab\n  memory: 15Gi\n  compute: {{limit: 25}}\n",
        100 / slices
    )
}

/// Children killed when the test ends, passed or failed.
struct Reaper(Vec<Child>);

impl Reaper {
    fn keep(&mut self, child: Child) -> &mut Child {
        self.0.push(child);
        self.0.last_mut().unwrap()
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn run(state: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.arg("run").arg("--state").arg(state).args(args);
    cmd
}

/// The agent as a service on an emulated one-A100 node in the `lab` pool, following `source`,
/// with its state in `<dir>/state` and its passes (JSON lines) to `passes`.
fn agent(dir: &Path, source: &Path, passes: Stdio) -> Child {
    agent_with(dir, source, passes, &[])
}

/// [`agent`] with more arguments.
fn agent_with(dir: &Path, source: &Path, passes: Stdio, extra: &[&str]) -> Child {
    agent_on_node(
        dir,
        "name: run-node\nlabels: {lab: \"yes\"}\ngpus:\n- {index: 0, model: NVIDIA A100-SXM4-80GB, uuid: GPU-a100-0}\n",
        source,
        passes,
        extra,
    )
}

/// [`agent_with`] on the node `node` (a NodeInventory's YAML).
fn agent_on_node(dir: &Path, node: &str, source: &Path, passes: Stdio, extra: &[&str]) -> Child {
    let node_file = dir.join("node.yaml");
    std::fs::write(&node_file, node).unwrap();
    let node = node_file;
    Command::new(BIN)
        .args([
            "agent",
            "--apply",
            "--interval",
            "1s",
            "--output",
            "json",
            "--source",
        ])
        .arg(source)
        .arg("--emulate")
        .arg(&node)
        .arg("--state")
        .arg(dir.join("state"))
        // Stands for /var/lib/gpuslice/cache, where pools' dataset caches are.
        .arg("--cache-root")
        .arg(dir.join("cache-root"))
        .args(extra)
        .stdout(passes)
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits (within a guard against hanging) until `check` holds.
fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !check() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn slices_are_granted_held_busy_queued_and_given_back() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("gitops");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("pool.yaml"), pool(2, "40Gi")).unwrap();
    let state = dir.path().join("state");
    let log = dir.path().join("agent.jsonl");
    let mut children = Reaper(Vec::new());
    children.keep(agent(
        dir.path(),
        &source,
        std::fs::File::create(&log).unwrap().into(),
    ));
    eventually("the slices exist", || {
        state.join("slices/gpu0-s1/config").exists()
    });

    // The first command gets the smaller-numbered slice, with everything the shim needs.
    let marker = dir.path().join("release");
    let holder = children.keep(run(&state, &["--policy", "small", "--", "sh", "-c"])
        .arg(format!(
            "echo \"$CUDA_VISIBLE_DEVICES|$GPUSLICE_SLICE_CONFIG|$LD_PRELOAD\"; while [ ! -e {} ]; do sleep 0.1; done",
            marker.display()
        ))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    let mut first_line = String::new();
    let mut out = std::io::BufReader::new(holder.stdout.take().unwrap());
    out.read_line(&mut first_line).unwrap();
    let parts: Vec<&str> = first_line.trim().split('|').collect();
    assert_eq!(parts[0], "GPU-a100-0");
    assert!(parts[1].ends_with("slices/gpu0-s0/config"), "{first_line}");
    assert!(parts[2].ends_with("libgpuslice.so"), "{first_line}");

    // The other slice is free: a second command runs at once.
    let second = run(&state, &["--memory", "20Gi", "--", "true"])
        .output()
        .unwrap();
    assert!(
        second.status.success(),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );

    // Hold the second slice too; a third caller is refused with --no-wait, or waits in line.
    children.keep(
        run(&state, &["--memory", "20Gi", "--", "sh", "-c"])
            .arg(format!(
                "while [ ! -e {} ]; do sleep 0.1; done",
                marker.display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    std::thread::sleep(Duration::from_millis(500));
    let refused = run(&state, &["--memory", "20Gi", "--no-wait", "--", "true"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("no free slice fits"));
    let waiter = run(&state, &["--memory", "20Gi", "--", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let too_big = run(&state, &["--memory", "60Gi", "--", "true"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&too_big.stderr).contains("no slice on this node has 60Gi"));

    // Re-slicing the GPU under held slices is blocked, naming them.
    std::fs::write(source.join("pool.yaml"), pool(4, "20Gi")).unwrap();
    let last_pass = || -> serde_json::Value {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.lines()
            .last()
            .and_then(|l| serde_json::from_str(l).ok())
            .unwrap_or_default()
    };
    eventually("the agent reports the claimed slices as busy", || {
        last_pass()["outcomes"][0]["blockedBy"][0]
            == serde_json::json!({"kind": "slices", "ids": ["gpu0-s0", "gpu0-s1"]})
    });
    let pass = last_pass();
    assert_eq!(pass["claims"].as_array().unwrap().len(), 2, "{pass}");
    let table = std::fs::read_to_string(state.join("gpu-0.slices.json")).unwrap();
    assert_eq!(table.matches("\"id\"").count(), 2, "the old table stays");

    // The commands end: the waiter ran, and the re-slicing goes ahead.
    std::fs::write(&marker, "").unwrap();
    let waited = waiter.wait_with_output().unwrap();
    assert!(waited.status.success());
    assert!(String::from_utf8_lossy(&waited.stderr).contains("waiting, 1 in line"));
    eventually("four slices after the re-slicing", || {
        state.join("slices/gpu0-s3/config").exists()
    });
}

/// Draining a claimed slice follows the claim's policy's CheckpointPolicy; a claim made without
/// a policy (or whose policy names none) is drained with the pool's. Each workload is told that
/// one: its signal, its interval, where its marker goes.
#[test]
fn the_claims_checkpoint_policy_wins_over_the_pools() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("gitops");
    std::fs::create_dir_all(&source).unwrap();
    let checkpoints = "---\napiVersion: gpuslice.io/v1alpha1\nkind: CheckpointPolicy\nmetadata: {name: pool-wide}\nspec: {signal: SIGTERM, gracePeriod: 1h, required: true}\n---\napiVersion: gpuslice.io/v1alpha1\nkind: CheckpointPolicy\nmetadata: {name: careful}\nspec: {signal: SIGUSR1, interval: 5m, gracePeriod: 1h, required: true}\n";
    let config = |slices: u32, memory: &str| {
        pool(slices, memory)
            .replace(
                "  memoryHeadroom: 1Gi\n",
                "  memoryHeadroom: 1Gi\n  checkpointPolicy: pool-wide\n",
            )
            .replace(
                "  compute: {limit: 25}\n",
                "  compute: {limit: 25}\n  checkpointPolicy: careful\n",
            )
            + checkpoints
    };
    std::fs::write(source.join("pool.yaml"), config(2, "40Gi")).unwrap();
    let state = dir.path().join("state");
    let mut children = Reaper(Vec::new());
    children.keep(agent(dir.path(), &source, Stdio::null()));
    eventually("the slices exist", || {
        state.join("slices/gpu0-s1/config").exists()
    });
    // Each workload writes down the signals it gets, and runs until told to end.
    let end = dir.path().join("end");
    let workload = |name: &str| {
        let seen = dir.path().join(name);
        format!(
            "trap 'echo USR1 >> {seen}' USR1; trap 'echo TERM >> {seen}' TERM; echo \"told $GPUSLICE_CHECKPOINT_SIGNAL every ${{GPUSLICE_CHECKPOINT_INTERVAL:-(none)}} s, marker $GPUSLICE_CHECKPOINT_DONE\"; echo ready; while [ ! -e {end} ]; do sleep 0.1; done",
            seen = seen.display(),
            end = end.display()
        )
    };
    for (name, args, told) in [
        (
            "with-policy",
            ["--policy", "small"],
            "told SIGUSR1 every 300 s, marker ",
        ),
        (
            "without",
            ["--memory", "20Gi"],
            "told SIGTERM every (none) s, marker ",
        ),
    ] {
        let child = children.keep(
            run(&state, &args)
                .args(["--", "sh", "-c", &workload(name)])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let marker = line
            .trim()
            .strip_prefix(told)
            .unwrap_or_else(|| panic!("{line}"));
        assert!(
            marker.starts_with(state.join("slices/gpu0-s").to_str().unwrap())
                && marker.ends_with("/checkpoint-done"),
            "{line}"
        );
        line.clear();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready");
    }
    // A re-slicing needs both claimed slices: each workload is asked to checkpoint.
    std::fs::write(source.join("pool.yaml"), config(4, "20Gi")).unwrap();
    let seen = |name: &str| std::fs::read_to_string(dir.path().join(name)).unwrap_or_default();
    eventually("both workloads are signalled", || {
        !seen("with-policy").is_empty() && !seen("without").is_empty()
    });
    assert_eq!(
        seen("with-policy").trim(),
        "USR1",
        "its policy's CheckpointPolicy"
    );
    assert_eq!(
        seen("without").trim(),
        "TERM",
        "the pool's CheckpointPolicy"
    );
    std::fs::write(&end, "").unwrap();
    eventually("four slices once they end", || {
        state.join("slices/gpu0-s3/config").exists()
    });
}

/// Whether the tests run as root (cgroup limits need it).
fn is_root() -> bool {
    std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap()) == 0
}

/// The agent on the emulated lab node, following one pool file: `pool(2, "40Gi")` as `edit`
/// changes it (given the test's folder). Returns the folder, the agent's state and the agent,
/// once the slices exist.
fn lab(
    edit: impl FnOnce(String, &Path) -> String,
) -> (tempfile::TempDir, std::path::PathBuf, Reaper) {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("gitops");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("pool.yaml"), edit(pool(2, "40Gi"), dir.path())).unwrap();
    let state = dir.path().join("state");
    let mut children = Reaper(Vec::new());
    children.keep(agent(dir.path(), &source, Stdio::null()));
    eventually("the slices exist", || {
        state.join("slices/gpu0-s1/config").exists()
    });
    (dir, state, children)
}

/// An agent (with `extra` arguments) following a source that holds `pool`, once its slices
/// exist: the scratch directory, the agent's state directory and the agent itself (killed by
/// the test, or with the directory's `Reaper`).
fn agent_on(pool: String, extra: &[&str]) -> (tempfile::TempDir, std::path::PathBuf, Child) {
    agent_until(pool, extra, "gpu0-s1")
}

/// [`agent_on`], waiting for slice `slice` to exist.
fn agent_until(
    pool: String,
    extra: &[&str],
    slice: &str,
) -> (tempfile::TempDir, std::path::PathBuf, Child) {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("gitops");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("pool.yaml"), pool).unwrap();
    let state = dir.path().join("state");
    let agent = agent_with(dir.path(), &source, Stdio::null(), extra);
    eventually("the slices exist", || {
        state.join("slices").join(slice).join("config").exists()
    });
    (dir, state, agent)
}

/// `dd`'s rate in bytes per second, from its last line (`67108864 bytes (…) copied, 3.2 s, …`).
fn dd_rate(stderr: &str) -> f64 {
    let line = stderr
        .lines()
        .rfind(|l| l.contains(" bytes "))
        .unwrap_or_else(|| panic!("no dd summary in {stderr:?}"));
    let bytes: f64 = line.split(' ').next().unwrap().parse().unwrap();
    let seconds: f64 = line
        .split(", ")
        .find_map(|part| part.strip_suffix(" s"))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no duration in {line:?}"));
    bytes / seconds
}

/// The pool's `io.bandwidthPerSlice` holds a slice's workload to it on the node's disks, read
/// and write, with direct I/O (no page cache), on the machine's real cgroups: the agent puts the
/// `gpuslice run` process in the slice's cgroup before granting it, so `dd` is born there.
#[test]
fn a_slices_workload_reads_and_writes_at_its_pools_io_limit() {
    let root = Path::new("/sys/fs/cgroup");
    let cgroups =
        match gpuslice_node::protections::iolimit::Cgroups::detect(root, Path::new("/sys/block")) {
            Ok(c) if is_root() => c,
            Ok(_) => return eprintln!("skipped: cgroup limits need root"),
            Err(e) => return eprintln!("skipped: {e}"),
        };
    const LIMIT: f64 = 20.0 * 1024.0 * 1024.0;
    let (dir, state, children) = lab(|pool, _| {
        pool.replace(
            "  memoryHeadroom: 1Gi\n",
            "  memoryHeadroom: 1Gi\n  io: {bandwidthPerSlice: 20Mi}\n",
        )
    });
    // 48 MiB on the local disk, written and synced before anything is timed.
    let data = dir.path().join("data");
    std::fs::write(&data, vec![7u8; 48 << 20]).unwrap();
    std::fs::File::open(&data).unwrap().sync_all().unwrap();
    let dd = |inside: bool, args: &str| -> f64 {
        let script = format!("dd {args} bs=1M 2>&1 >/dev/null");
        let out = if inside {
            run(&state, &["--policy", "small", "--", "sh", "-c", &script])
                .output()
                .unwrap()
        } else {
            Command::new("sh").args(["-c", &script]).output().unwrap()
        };
        assert!(out.status.success(), "{out:?}");
        dd_rate(&String::from_utf8_lossy(&out.stdout))
    };
    let read = format!("if={} of=/dev/null iflag=direct", data.display());
    let written = dir.path().join("written");
    let write = format!(
        "if=/dev/zero of={} count=48 oflag=direct",
        written.display()
    );
    let free_read = dd(false, &read);
    let slice_read = dd(true, &read);
    let slice_write = dd(true, &write);
    eprintln!(
        "direct read unthrottled {:.1} MiB/s; in the slice: read {:.1} MiB/s, write {:.1} MiB/s (limit 20 MiB/s, {})",
        free_read / 1048576.0,
        slice_read / 1048576.0,
        slice_write / 1048576.0,
        cgroups.kind()
    );
    for (what, rate) in [("read", slice_read), ("write", slice_write)] {
        assert!(
            (rate - LIMIT).abs() <= 0.1 * LIMIT,
            "{what} at {:.1} MiB/s, not within 10% of 20 MiB/s",
            rate / 1048576.0
        );
    }
    // The slice's cgroup goes once its workload is gone.
    let group = match &cgroups.controller {
        gpuslice_node::protections::iolimit::Controller::V1(blkio) => blkio.clone(),
        gpuslice_node::protections::iolimit::Controller::V2(unified) => unified.clone(),
    }
    .join("gpuslice/run-node");
    eventually("the agent removes the slice's cgroup", || {
        std::fs::read_dir(&group)
            .map_or(true, |mut d| !d.any(|e| e.is_ok_and(|e| e.path().is_dir())))
    });
    // What the agent leaves (the node's group, empty) goes with the test.
    drop(children);
    let _ = std::fs::remove_dir(&group);
    let _ = std::fs::remove_dir(group.parent().unwrap());
}

/// A policy's `host` CPU and memory hold a `gpuslice run` command on the machine's real
/// cgroups: one whole core of its own (a cpuset) and a hard memory limit it cannot allocate past.
#[test]
fn a_policys_host_cpu_and_memory_hold_its_command() {
    let root = Path::new("/sys/fs/cgroup");
    let cgroups = match gpuslice_node::protections::hostlimit::HostCgroups::detect(root) {
        Ok(c) if is_root() => c,
        Ok(_) => return eprintln!("skipped: cgroup limits need root"),
        Err(e) => return eprintln!("skipped: {e}"),
    };
    let (_dir, state, children) = lab(|pool, _| {
        pool.replace(
            "  compute: {limit: 25}\n",
            "  compute: {limit: 25}\n  host: {cpu: \"1\", memory: 64Mi}\n",
        )
    });
    // What the command may use, then an allocation four times its memory.
    let out = run(&state, &["--policy", "small", "--", "sh", "-c"])
        .arg(
            "grep Cpus_allowed_list /proc/self/status; \
             python3 -c 'b = bytearray(256 << 20); print(len(b))'; echo exit=$?",
        )
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}");
    let allowed = text
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(str::trim)
        .unwrap_or_default();
    assert_eq!(
        gpuslice_node::protections::hostlimit::parse_cpus(allowed).len(),
        1,
        "one core of its own: {text}"
    );
    assert!(
        text.contains("exit=137") && !text.contains("268435456"),
        "the allocation past 64Mi is killed: {text}"
    );
    drop(children);
    let dirs: Vec<std::path::PathBuf> = match &cgroups {
        gpuslice_node::protections::hostlimit::HostCgroups::V1 {
            cpu,
            cpuset,
            memory,
        } => vec![cpu.clone(), cpuset.clone(), memory.clone()],
        gpuslice_node::protections::hostlimit::HostCgroups::V2(unified) => vec![unified.clone()],
    };
    // What the agent leaves (the node's groups, empty once the command is gone) goes too.
    for group in dirs.iter().map(|d| d.join("gpuslice/run-node")) {
        for slice in std::fs::read_dir(&group).into_iter().flatten().flatten() {
            if slice.path().is_dir() {
                let _ = std::fs::remove_dir(slice.path());
            }
        }
        let _ = std::fs::remove_dir(&group);
        let _ = std::fs::remove_dir(group.parent().unwrap());
    }
}

/// A pool's `io.localCache`: `gpuslice cache SOURCE` on the node gives a read-only local copy,
/// fetched once; asked again, the cached one; the cache outlives the agent. A pool that points
/// its cache outside the cache root gets none, and the root agent removes nothing there.
#[test]
fn the_pools_dataset_cache_fetches_once_and_survives_a_restart() {
    let (dir, state, children) = lab(|pool, dir| {
        pool.replace(
            "  memoryHeadroom: 1Gi\n",
            &format!(
                "  memoryHeadroom: 1Gi\n  io: {{localCache: {{path: /var/lib/gpuslice/cache/datasets, size: 1Mi, sources: [{}]}}}}\n",
                dir.join("datasets").display()
            ),
        )
    });
    let cache = dir.path().join("cache-root/datasets");
    let source = dir.path().join("gitops");
    std::fs::create_dir_all(dir.path().join("datasets")).unwrap();
    let dataset = dir.path().join("datasets/shard-0");
    std::fs::write(&dataset, b"tokens tokens tokens").unwrap();
    let ask = |what: &str| {
        Command::new(BIN)
            .arg("cache")
            .arg(what)
            .arg("--state")
            .arg(&state)
            .output()
            .unwrap()
    };
    eventually("the cache is open", || {
        ask(dataset.to_str().unwrap()).status.success()
    });
    let out = ask(dataset.to_str().unwrap());
    let local = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        local.starts_with(cache.join("objects").to_str().unwrap()),
        "{local}"
    );
    assert_eq!(std::fs::read(&local).unwrap(), b"tokens tokens tokens");
    assert!(String::from_utf8_lossy(&out.stderr).contains("cached"));
    let refused = ask("relative/path");
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("neither an absolute path"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    // The root agent reads nothing the pool does not list, nor through a link out of it.
    let outside = ask("/etc/shadow");
    assert!(!outside.status.success());
    assert!(
        String::from_utf8_lossy(&outside.stderr).contains("not under any of GpuPool lab's"),
        "{}",
        String::from_utf8_lossy(&outside.stderr)
    );
    std::os::unix::fs::symlink("/etc/shadow", dir.path().join("datasets/shadow")).unwrap();
    let linked = ask(dir.path().join("datasets/shadow").to_str().unwrap());
    assert!(
        String::from_utf8_lossy(&linked.stderr).contains("symbolic link"),
        "{}",
        String::from_utf8_lossy(&linked.stderr)
    );
    // A new agent finds the cache as it was.
    drop(children);
    let mut children = Reaper(Vec::new());
    children.keep(agent(dir.path(), &source, Stdio::null()));
    eventually("the new agent answers from the cache", || {
        let out = ask(dataset.to_str().unwrap());
        out.status.success() && String::from_utf8_lossy(&out.stderr).contains("cached")
    });

    // The pool now points its cache at a folder of other things: the source is refused (the
    // CRD's rule), the last good pool stays in force, and the agent (root) removes nothing there.
    let victim = dir.path().join("victim");
    for sub in ["objects", "tmp"] {
        std::fs::create_dir_all(victim.join(sub)).unwrap();
        std::fs::write(victim.join(sub).join("precious"), b"keep").unwrap();
    }
    let pool = std::fs::read_to_string(source.join("pool.yaml")).unwrap();
    std::fs::write(
        source.join("pool.yaml"),
        pool.replace("/var/lib/gpuslice/cache/datasets", victim.to_str().unwrap()),
    )
    .unwrap();
    let validate = Command::new(BIN)
        .arg("validate")
        .arg(&source)
        .output()
        .unwrap();
    assert!(!validate.status.success());
    assert!(
        String::from_utf8_lossy(&validate.stdout)
            .contains("path must be a folder directly under /var/lib/gpuslice/cache"),
        "{}",
        String::from_utf8_lossy(&validate.stdout)
    );
    // A few of the agent's passes (one a second).
    std::thread::sleep(std::time::Duration::from_secs(3));
    let out = ask(dataset.to_str().unwrap());
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with(cache.to_str().unwrap()));
    for sub in ["objects", "tmp"] {
        assert!(
            victim.join(sub).join("precious").exists(),
            "{sub}/precious removed"
        );
    }
}

/// A `gpuslice run` of policy `small` holding its slice until `end` exists; returns it with
/// the slice it got, once its command runs.
fn hold(state: &Path, end: &Path) -> (Child, String) {
    let mut child = run(state, &["--policy", "small", "--", "sh", "-c"])
        .arg(format!(
            "echo \"$GPUSLICE_SLICE_CONFIG\"; while [ ! -e {} ]; do sleep 0.1; done",
            end.display()
        ))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let slice = Path::new(line.trim())
        .parent()
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| panic!("no slice config in {line:?}"));
    (child, slice)
}

/// The standalone agent isolates faults as the in-cluster one does, for pools with
/// `faultIsolation`: an XID the kernel traces to a `gpuslice run` quarantines that run's slice
/// only, until the run lets go of it; a fatal XID takes the GPU out of service — its runs are
/// drained by the pool's CheckpointPolicy and no new run gets a slice — until root says the GPU
/// was reset (`gpuslice gpu-reset`).
#[test]
fn xid_errors_quarantine_a_runs_slice_or_take_the_gpu_out_until_root_resets_it() {
    if !is_root() {
        // `gpuslice gpu-reset` is root's.
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("gitops");
    std::fs::create_dir_all(&source).unwrap();
    let pool = pool(4, "20Gi").replace(
        "  memoryHeadroom: 1Gi\n",
        "  memoryHeadroom: 1Gi\n  faultIsolation: {enabled: true}\n  checkpointPolicy: quick\n",
    ) + "---\napiVersion: gpuslice.io/v1alpha1\nkind: CheckpointPolicy\nmetadata: {name: quick}\nspec: {signal: SIGTERM, gracePeriod: 1s}\n";
    std::fs::write(source.join("pool.yaml"), pool).unwrap();
    // The kernel log is a file written as the kernel would; the emulator puts GPU 0 at PCI
    // 0000:10:00.
    let kmsg = dir.path().join("kmsg");
    std::fs::write(&kmsg, "").unwrap();
    let kernel = |code: u64, pid: u32| gpuslice_testcluster::write_kernel_xid(&kmsg, code, pid);
    let state = dir.path().join("state");
    let mut children = Reaper(Vec::new());
    children.keep(agent_with(
        dir.path(),
        &source,
        Stdio::null(),
        &["--kernel-log", kmsg.to_str().unwrap()],
    ));
    eventually("the slices exist", || {
        state.join("slices/gpu0-s3/config").exists()
    });
    let machine = gpuslice_contract::StateDir::new(&state).emulated_machine("run-node");
    let inject = |code: u64| {
        gpuslice_emulator::Store::open(&machine)
            .unwrap()
            .mutate(|m| m.inject_xid(0, code))
            .unwrap()
            .unwrap()
    };
    let quarantined = || -> Vec<(Option<String>, u64)> {
        std::fs::read_to_string(state.join("quarantine.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Vec<serde_json::Value>>(&t).ok())
            .unwrap_or_default()
            .iter()
            .map(|q| {
                (
                    q["slice"].as_str().map(str::to_string),
                    q["xid"].as_u64().unwrap_or_default(),
                )
            })
            .collect()
    };
    let (end_a, end_b) = (dir.path().join("end-a"), dir.path().join("end-b"));
    let (a, slice_a) = hold(&state, &end_a);
    let pid_a = a.id();
    children.keep(a);
    let (b, slice_b) = hold(&state, &end_b);
    let b = children.keep(b);
    assert_ne!(slice_a, slice_b);

    // XID 31 that the kernel traces to run A: A's slice only.
    kernel(31, pid_a);
    inject(31);
    eventually("A's slice is quarantined", || {
        quarantined() == [(Some(slice_a.clone()), 31)]
    });
    // A lets go of its slice: it comes back.
    std::fs::write(&end_a, "").unwrap();
    eventually("A's slice is back", || quarantined().is_empty());

    // XID 79 (the GPU fell off the bus): the GPU is out; B is told (SIGTERM) and stopped.
    inject(79);
    eventually("the GPU is out of service", || {
        quarantined() == [(None, 79)]
    });
    eventually("B is drained", || b.try_wait().unwrap().is_some());
    let refused = run(&state, &["--policy", "small", "--no-wait", "--", "true"])
        .output()
        .unwrap();
    assert!(
        !refused.status.success(),
        "a run got a slice of a GPU out of service"
    );
    // Root says the GPU was reset: it is back.
    let reset = Command::new(BIN)
        .args(["gpu-reset", "0", "--state"])
        .arg(&state)
        .output()
        .unwrap();
    assert!(
        reset.status.success(),
        "{}",
        String::from_utf8_lossy(&reset.stderr)
    );
    eventually("the GPU is back", || quarantined().is_empty());
    let ran = run(&state, &["--policy", "small", "--no-wait", "--", "true"])
        .output()
        .unwrap();
    assert!(
        ran.status.success(),
        "{}",
        String::from_utf8_lossy(&ran.stderr)
    );
}

/// An agent on the lab pool (four 20 GiB slices of GPU 0) whose watchdog reads NVML every
/// `interval`, and the emulated driver for workloads to run with.
struct WatchedNode {
    _dir: tempfile::TempDir,
    state: std::path::PathBuf,
    children: Reaper,
    probe: String,
    lib: std::path::PathBuf,
    machine: std::path::PathBuf,
}

impl WatchedNode {
    fn start(interval: &str) -> WatchedNode {
        WatchedNode::on(pool(4, "20Gi"), interval)
    }

    /// The node following `pool` (whose policy is `small`).
    fn on(pool: String, interval: &str) -> WatchedNode {
        WatchedNode::cut(pool, interval, "gpu0-s1")
    }

    /// [`WatchedNode::on`], once slice `slice` exists.
    fn cut(pool: String, interval: &str, slice: &str) -> WatchedNode {
        let (dir, state, agent) =
            agent_until(pool, &["--memory-watchdog-interval", interval], slice);
        let (probe, lib) = gpuslice_testcluster::build_probe(Path::new(BIN), dir.path());
        let machine = gpuslice_contract::StateDir::new(&state).emulated_machine("run-node");
        WatchedNode {
            _dir: dir,
            state,
            children: Reaper(vec![agent]),
            probe: probe.display().to_string(),
            lib,
            machine,
        }
    }

    /// `command` with the emulated driver at hand.
    fn with_driver<'c>(&self, command: &'c mut Command) -> &'c mut Command {
        command
            .env("LD_LIBRARY_PATH", &self.lib)
            .env(gpuslice_contract::env::EMULATOR_STATE, &self.machine)
            .stderr(Stdio::null())
    }

    /// The pids NVIDIA's Python client (pynvml, `GPUSLICE_TEST_PYTHON`) lists on GPU 0: its
    /// compute processes and its MPS clients. `None` (said) without that Python.
    fn nvml_processes(&self) -> Option<(Vec<u32>, Vec<u32>)> {
        let Ok(python) = std::env::var("GPUSLICE_TEST_PYTHON") else {
            eprintln!("SKIPPED the pynvml check: GPUSLICE_TEST_PYTHON is not set");
            return None;
        };
        let script = "import json, pynvml\n\
            pynvml.nvmlInit()\n\
            h = pynvml.nvmlDeviceGetHandleByIndex(0)\n\
            pids = lambda ps: [p.pid for p in ps]\n\
            print(json.dumps([pids(pynvml.nvmlDeviceGetComputeRunningProcesses(h)),\n\
                pids(pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h))]))\n";
        let out = self
            .with_driver(Command::new(python).args(["-c", script]))
            .stderr(Stdio::inherit())
            .output()
            .unwrap();
        assert!(out.status.success(), "pynvml: {out:?}");
        Some(serde_json::from_slice(&out.stdout).unwrap())
    }

    /// Whether the child with this pid (one the node keeps) has not ended.
    fn still_runs(&mut self, pid: u32) -> bool {
        let child = self.children.0.iter_mut().find(|c| c.id() == pid);
        child.is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    /// `script` on a slice of policy `small` (`gpuslice run`), its output piped when asked.
    fn run(&self, script: &str, piped: bool) -> Child {
        let mut command = run(
            &self.state,
            &["--policy", "small", "--", "sh", "-c", script],
        );
        self.with_driver(&mut command)
            .stdout(if piped { Stdio::piped() } else { Stdio::null() })
            .spawn()
            .unwrap()
    }
}

/// The first line a child printed.
fn first_line(child: &mut Child) -> String {
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    line.trim().to_string()
}

/// The memory watchdog is the guarantee behind the shim: a workload that bypasses the shim
/// (here it clears `LD_PRELOAD` before exec, as a static binary calling the driver would never
/// load it) and takes more than its slice's cap is found by the agent through NVML's
/// per-process figures and stopped (SIGTERM: the run ends with 143); a neighbour within its cap
/// on the same GPU keeps running.
#[test]
fn a_workload_that_bypasses_the_shim_past_its_cap_is_stopped_by_the_agent() {
    let mut node = WatchedNode::start("200ms");
    let probe = node.probe.clone();
    let mut within = node.run(&format!("exec {probe} link hold 8192"), true);
    assert_eq!(first_line(&mut within), format!("held={}", 8u64 << 30));
    let within = node.children.keep(within).id();
    let mut over = node.run(
        &format!("exec env -u LD_PRELOAD {probe} link hold 24576"),
        true,
    );
    // Without the shim the driver gave it all: 24 GiB on a 20 GiB slice.
    assert_eq!(first_line(&mut over), format!("held={}", 24u64 << 30));
    let status = exit_of(&mut over, "the over-cap workload");
    assert_eq!(status.code(), Some(128 + 15), "stopped by SIGTERM");
    assert!(
        node.still_runs(within),
        "the neighbour within its cap runs on"
    );
}

/// The arbiter governs compute as the shim governs memory, from inside the workload; the
/// agent's watchdog is the guarantee for both. A workload that launches kernels around the shim
/// (it clears `LD_PRELOAD` before exec, as a static binary would never load the shim) uses far
/// more than its policy's 25 % limit; NVML's per-process SM figures show it, and the agent stops
/// it (SIGTERM: the run ends with 143), while a governed neighbour on the same GPU runs on.
#[test]
fn a_workload_that_launches_around_the_shim_past_its_compute_limit_is_stopped_by_the_agent() {
    let mut node = WatchedNode::start("300ms");
    // 2 ms kernels, one after another, for a minute.
    let worker = format!("{BIN} bench compute-worker --kernel-us 2000 --seconds 60");
    let governed = node.run(&format!("exec {worker}"), false);
    let governed = node.children.keep(governed).id();
    let mut around = node.run(&format!("exec env -u LD_PRELOAD {worker}"), false);
    let status = exit_of(&mut around, "the workload past its compute limit");
    assert_eq!(status.code(), Some(128 + 15), "stopped by SIGTERM");
    // The governed neighbour, within its limit, runs on.
    std::thread::sleep(Duration::from_secs(3));
    assert!(node.still_runs(governed), "the governed workload runs on");
}

/// A process that uses a pool's GPU without holding a slice of it (here one started outside
/// `gpuslice run` with the driver at hand, as a host user, or a pod whose image sets
/// `NVIDIA_VISIBLE_DEVICES=all`, would) is found by the agent through NVML and stopped
/// (SIGTERM: it ends with 143), while the workload of a slice on the same GPU runs on.
#[test]
fn a_process_on_a_pools_gpu_outside_every_slice_is_stopped_by_the_agent() {
    let mut node = WatchedNode::start("200ms");
    let probe = node.probe.clone();
    let mut sliced = node.run(&format!("exec {probe} link hold 1024"), true);
    assert_eq!(first_line(&mut sliced), format!("held={}", 1u64 << 30));
    let sliced = node.children.keep(sliced).id();
    let mut stray = node
        .with_driver(Command::new(&probe).args(["link", "hold", "1024"]))
        .env("CUDA_VISIBLE_DEVICES", "0")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    assert_eq!(first_line(&mut stray), format!("held={}", 1u64 << 30));
    let status = exit_of(&mut stray, "the stray process");
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(status.signal(), Some(15), "stopped by SIGTERM");
    assert!(node.still_runs(sliced), "the slice's workload runs on");
}

/// How `child` ended, within a minute (else the test fails: `what` still runs).
fn exit_of(child: &mut Child, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "{what} still runs");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// VmRSS of a process, in bytes.
fn resident(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        * 1024
}

/// The agent's socket is open to every local user, so it holds against hostile callers: a
/// 200 MB line without an end is cut off after 64 KiB, 10,000 idle connections are refused past
/// the caller's share with the reason, the agent stays under the memory limit the chart gives
/// it (128 MiB), and once the flood is gone a new session is served.
#[test]
fn the_agents_socket_holds_against_an_endless_line_and_a_flood_of_connections() {
    use std::io::{Read as _, Write as _};
    use std::os::unix::net::UnixStream;
    const CHART_LIMIT: u64 = 128 << 20;
    let (_dir, state, agent) = agent_on(pool(2, "40Gi"), &[]);
    let children = Reaper(vec![agent]);
    let agent = children.0[0].id();
    let socket = gpuslice_contract::StateDir::new(&state).socket();

    // A line that never ends: the agent stops reading and hangs up long before 200 MB.
    let mut endless = UnixStream::connect(&socket).unwrap();
    let chunk = vec![b'x'; 1 << 20];
    let mut sent = 0usize;
    while sent < 200 << 20 {
        match endless.write(&chunk) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    assert!(sent < 200 << 20, "the agent read {sent} bytes of one line");
    assert!(resident(agent) < CHART_LIMIT, "{} bytes", resident(agent));

    // 10,000 connections that say nothing.
    let idle: Vec<UnixStream> = (0..10_000)
        .map(|_| UnixStream::connect(&socket).unwrap())
        .collect();
    let mut refusal = String::new();
    let mut last = idle.last().unwrap();
    last.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    last.read_to_string(&mut refusal).unwrap();
    assert!(
        refusal.contains("refused") && refusal.contains("connections to the agent open already"),
        "{refusal}"
    );
    let rss = resident(agent);
    eprintln!("agent RSS after the flood: {} MiB", rss >> 20);
    assert!(rss < CHART_LIMIT, "{rss} bytes with 10,000 connections");

    // The flood gone, a new caller gets a slice.
    drop(idle);
    eventually("a new session is served", || {
        run(&state, &["--no-wait", "--policy", "small", "--", "true"])
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .success()
    });
}

/// Once governed, a workload stays governed: with the agent killed under a running workload,
/// its kernel launches wait (they do not run ungoverned), and they go on under the grants of the
/// agent started again.
#[test]
fn launches_wait_while_the_agent_is_away_and_are_governed_again_when_it_is_back() {
    let (dir, state, mut first_agent) = agent_on(pool(2, "40Gi"), &[]);
    let source = dir.path().join("gitops");
    let mut children = Reaper(Vec::new());
    let (probe, lib) = gpuslice_testcluster::build_probe(Path::new(BIN), dir.path());
    let machine = gpuslice_contract::StateDir::new(&state).emulated_machine("run-node");
    let stderr = dir.path().join("workload.err");
    let mut workload = run(
        &state,
        &[
            "--policy",
            "small",
            "--",
            &probe.display().to_string(),
            "link",
            "spin",
        ],
    )
    .env("LD_LIBRARY_PATH", &lib)
    .env(gpuslice_contract::env::EMULATOR_STATE, &machine)
    .stdout(Stdio::piped())
    .stderr(std::fs::File::create(&stderr).unwrap())
    .spawn()
    .unwrap();
    let progress = workload.stdout.take().unwrap();
    children.keep(workload);
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(progress).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let next = |within: Duration| rx.recv_timeout(within).ok();
    assert!(
        next(Duration::from_secs(60)).is_some(),
        "launches go through"
    );

    first_agent.kill().unwrap();
    first_agent.wait().unwrap();
    // What was under way when the agent died; after that, nothing goes through.
    std::thread::sleep(Duration::from_millis(500));
    while rx.try_recv().is_ok() {}
    assert_eq!(
        next(Duration::from_secs(2)),
        None,
        "launches went on without an agent"
    );

    let restarted = Instant::now();
    children.keep(agent(dir.path(), &source, Stdio::null()));
    assert!(
        next(Duration::from_secs(60)).is_some(),
        "launches go on under the new agent"
    );
    eprintln!(
        "launches governed again {:.2} s after the agent was started again",
        restarted.elapsed().as_secs_f64()
    );
    // `gpuslice run` claimed its slice again, so the new agent's watchdog, which stops
    // processes on a pool's GPU outside every slice, leaves the workload be.
    eventually("the slice is claimed again", || {
        std::fs::read_to_string(&stderr)
            .unwrap()
            .contains("gpuslice run: slice gpu0-s0 held again")
    });
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        children.0[0].try_wait().unwrap(),
        None,
        "the workload runs on under the new agent"
    );
    let said = std::fs::read_to_string(&stderr).unwrap();
    assert!(
        said.contains("kernel launches wait until it is back") && said.contains("governed again"),
        "{said}"
    );
}

/// A slice's directory is its workload's to write; the root agent never follows what the
/// workload put there: a link in the ledger's place (aimed at a file the agent would otherwise
/// extend and map) is replaced by a ledger of the agent's own, the file it aimed at untouched.
#[test]
fn the_agent_replaces_a_link_planted_in_a_slice_directory_without_following_it() {
    let (dir, state, _children) = lab(|pool, _| pool);
    let target = dir.path().join("precious");
    std::fs::write(&target, b"").unwrap();
    let ledger = state.join("slices/gpu0-s0/memory");
    std::fs::remove_file(&ledger).unwrap();
    std::os::unix::fs::symlink(&target, &ledger).unwrap();
    eventually("the agent put its ledger back", || {
        std::fs::symlink_metadata(&ledger).is_ok_and(|m| m.file_type().is_file())
    });
    assert_eq!(std::fs::metadata(&target).unwrap().len(), 0, "not followed");
    assert_eq!(
        std::fs::metadata(&ledger).unwrap().len(),
        gpuslice_emulator::shm::FILE_SIZE as u64
    );
}

#[test]
fn an_elastic_pool_re_cuts_an_idle_gpu_for_a_waiting_command_and_keeps_the_busy_one() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("gitops");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(
        source.join("pool.yaml"),
        "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {name: lab}\nspec:\n  nodeSelector: {matchLabels: {lab: \"yes\"}}\n  layout: {software: {slices: 4, memory: 20Gi, compute: 25}}\n  elastic:\n    minDwell: 1m\n    shapes:\n    - {name: quarters, layout: {software: {slices: 4, memory: 20Gi, compute: 25}}}\n    - {name: halves, layout: {software: {slices: 2, memory: 40Gi, compute: 50}}}\n---\napiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: small}\nspec: {pool: lab, memory: 8Gi}\n---\napiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: big}\nspec: {pool: lab, memory: 30Gi}\n",
    )
    .unwrap();
    let state = dir.path().join("state");
    let log = dir.path().join("agent.jsonl");
    let mut children = Reaper(Vec::new());
    children.keep(agent_on_node(
        dir.path(),
        "name: run-node\nlabels: {lab: \"yes\"}\ngpus:\n- {index: 0, model: NVIDIA A100-SXM4-80GB, uuid: GPU-a100-0}\n- {index: 1, model: NVIDIA A100-SXM4-80GB, uuid: GPU-a100-1}\n",
        &source,
        std::fs::File::create(&log).unwrap().into(),
        &[],
    ));
    eventually("both GPUs in quarters", || {
        state.join("slices/gpu1-s3/config").exists()
    });
    // A small command holds a quarter of GPU 0.
    let marker = dir.path().join("release");
    let hold = format!("while [ ! -e {} ]; do sleep 0.1; done", marker.display());
    let holder = children.keep(
        run(&state, &["--policy", "small", "--", "sh", "-c", &hold])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let holder_pid = holder.id();
    eventually("the small command holds gpu0-s0", || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .last()
            .is_some_and(|l| l.contains("\"slice\":\"gpu0-s0\""))
    });
    // A command that needs a half waits (no slice fits now, but a re-cut would give one), then
    // runs on GPU 1, re-cut to halves; GPU 0 keeps its quarters and its command.
    let big = run(
        &state,
        &[
            "--policy",
            "big",
            "--",
            "sh",
            "-c",
            "echo $GPUSLICE_SLICE_CONFIG",
        ],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&big.stderr);
    assert!(big.status.success(), "{stderr}");
    assert!(stderr.contains("waiting, 1 in line"), "{stderr}");
    let config = String::from_utf8_lossy(&big.stdout);
    assert!(config.trim().ends_with("slices/gpu1-s0/config"), "{config}");
    let slice: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(config.trim()).unwrap()).unwrap();
    assert_eq!(slice["memoryBytes"], 40u64 << 30, "{slice}");
    assert!(state.join("slices/gpu0-s3/config").exists());
    assert!(!state.join("slices/gpu1-s2/config").exists());
    assert!(
        std::path::Path::new(&format!("/proc/{holder_pid}")).exists(),
        "the small command was never stopped"
    );
    // The shapes are kept for a restarted agent: GPU 1 halves since the re-cut, GPU 0 quarters.
    let kept: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(state.join("elastic.json")).unwrap())
            .unwrap();
    let shape = |gpu: u64| -> serde_json::Value {
        kept["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["index"] == gpu)
            .map(|g| g["shape"].clone())
            .unwrap_or_default()
    };
    assert_eq!(shape(1)["name"], "halves", "{kept}");
    assert!(shape(1)["since"].is_string(), "{kept}");
    assert_eq!(shape(0)["name"], "quarters", "{kept}");
    let reason = kept["pools"]["lab"]["lastRecut"]["reason"]
        .as_str()
        .unwrap_or_default();
    assert!(
        reason.contains("quarters → halves") && reason.contains("big"),
        "{kept}"
    );
    std::fs::write(&marker, "").unwrap();
}

/// A command run here holds one slice: a policy that gives each workload several (`count: 2`)
/// is refused with what to do, rather than quietly running on one GPU of the two it asked for.
#[test]
fn a_policy_of_several_slices_is_refused_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("gitops");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(
        source.join("pool.yaml"),
        "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {name: lab}\nspec:\n  nodeSelector: {matchLabels: {lab: \"yes\"}}\n  layout: {exclusive: {}}\n---\napiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: duo}\nspec: {pool: lab, memory: 60Gi, count: 2}\n",
    )
    .unwrap();
    let state = dir.path().join("state");
    let mut children = Reaper(Vec::new());
    children.keep(agent_on_node(
        dir.path(),
        "name: run-node\nlabels: {lab: \"yes\"}\ngpus:\n- {index: 0, model: NVIDIA A100-SXM4-80GB}\n- {index: 1, model: NVIDIA A100-SXM4-80GB}\n",
        &source,
        Stdio::null(),
        &[],
    ));
    eventually("the GPUs are whole slices", || {
        state.join("slices/gpu1/config").exists()
    });
    let refused = run(&state, &["--policy", "duo", "--no-wait", "--", "true"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("GpuSlicePolicy \"duo\" gives each workload 2 slices (spec.count), and a command run here gets one"),
        "{said}"
    );
}

/// Two MPS slices of GPU 0 (20 GiB, half the SMs each), and policy `small` on them, whose
/// compute limit is the slice's share.
fn mps_pool() -> String {
    pool(2, "20Gi")
        .replace("    software: ", "    mps: ")
        .replace("limit: 25", "limit: 50")
}

/// The kernels the emulated GPU 0 ran for `pid`.
fn kernels_of(machine: &Path, pid: u32) -> Vec<gpuslice_emulator::timeline::Interval> {
    kernels_on(machine, gpuslice_emulator::device_key(0, None), pid)
}

/// The kernels process `pid` ran on the emulated device of ledger key `device`.
fn kernels_on(machine: &Path, device: u32, pid: u32) -> Vec<gpuslice_emulator::timeline::Interval> {
    let path = gpuslice_emulator::timeline::timeline_path(machine, device);
    gpuslice_emulator::timeline::Timeline::open(&path)
        .unwrap()
        .intervals()
        .into_iter()
        .filter(|k| k.pid == pid)
        .collect()
}

/// The pid a compute worker reported (its JSON's `pid`).
fn worker_pid(output: &std::process::Output) -> u32 {
    let report: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&output.stdout)));
    report["pid"].as_u64().unwrap() as u32
}

/// An `mps` layout: the agent runs the GPU's MPS control daemon (NVIDIA's command-line tool,
/// emulated) with the slice's share and memory as its defaults, tells each workload its daemon,
/// share and pinned memory limit, and starts the daemon again when it dies. Two workloads run
/// their kernels at the same time, each on half the SMs, also the one that asks MPS for all of
/// them (a client's share only lowers the daemon's); one that bypasses the shim stops at MPS's
/// pinned limit; one that leaves MPS (another pipe directory) and takes the whole GPU is stopped
/// by the agent.
#[test]
fn an_mps_pool_runs_its_workloads_side_by_side_each_on_its_share_of_the_sms() {
    let mut node = WatchedNode::on(mps_pool(), "300ms");
    let contract = gpuslice_contract::StateDir::new(&node.state);
    let pipe = contract.mps_pipe("gpu0");
    eventually("the GPU's MPS daemon listens", || {
        pipe.join("control").exists()
    });
    let pid_file = pipe.join("nvidia-cuda-mps-control.pid");
    let daemon = std::fs::read_to_string(&pid_file).unwrap();
    let told = run(
        &node.state,
        &[
            "--policy",
            "small",
            "--",
            "sh",
            "-c",
            "echo $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $CUDA_MPS_PINNED_DEVICE_MEM_LIMIT $CUDA_MPS_PIPE_DIRECTORY",
        ],
    )
    .output()
    .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&told.stdout),
        format!("50 0=20480M {}\n", pipe.display())
    );

    let worker =
        |seconds: u32| format!("{BIN} bench compute-worker --kernel-us 2000 --seconds {seconds}");
    // Both start their kernels at the same moment, once both are up.
    let start = gpuslice_emulator::timeline::now_ns() + 3_000_000_000;
    let together = format!("{} --start-at {start}", worker(2));
    let modest = node.run(&format!("exec {together}"), true);
    let greedy = node.run(
        &format!("exec env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 {together}"),
        true,
    );
    // Mid-run, as NVIDIA's own client (pynvml) sees GPU 0.
    let mid_run = Duration::from_nanos(
        (start + 1_000_000_000).saturating_sub(gpuslice_emulator::timeline::now_ns()),
    );
    std::thread::sleep(mid_run);
    let listed = node.nvml_processes();
    let (modest, greedy) = (
        modest.wait_with_output().unwrap(),
        greedy.wait_with_output().unwrap(),
    );
    let (a, b) = (
        kernels_of(&node.machine, worker_pid(&modest)),
        kernels_of(&node.machine, worker_pid(&greedy)),
    );
    side_by_side_on_half_the_sms(&a, &b);
    if let Some((compute, mps)) = listed {
        let server: u32 = daemon.trim().parse().unwrap();
        let workers = [worker_pid(&modest), worker_pid(&greedy)];
        for worker in workers {
            assert!(
                compute.contains(&worker) && mps.contains(&worker),
                "worker {worker} is an MPS client (M+C): compute {compute:?}, MPS {mps:?}"
            );
        }
        assert!(
            compute.contains(&server) && !mps.contains(&server),
            "the daemon's server {server} holds a context of its own and is no client: compute {compute:?}, MPS {mps:?}"
        );
    }

    // Around the shim, MPS's pinned limit is what stops it: 20 GiB of the 24 asked for.
    let probe = node.probe.clone();
    let mut unshimmed = node.run(
        &format!("exec env -u LD_PRELOAD {probe} link hold 24576"),
        true,
    );
    assert_eq!(first_line(&mut unshimmed), format!("held={}", 20u64 << 30));
    node.children.keep(unshimmed);

    // Out of MPS, on the whole GPU for as long as it likes: stopped by the agent.
    let mut outside = node.run(
        &format!(
            "exec env CUDA_MPS_PIPE_DIRECTORY=/nonexistent {}",
            worker(60)
        ),
        false,
    );
    let status = exit_of(&mut outside, "the workload outside MPS");
    assert_eq!(status.code(), Some(128 + 15), "stopped by SIGTERM");

    // The watchdog took the MPS server, on the GPU with no slice of its own, for no stray.
    let first = std::fs::read_to_string(&pid_file).unwrap();
    assert_eq!(first, daemon, "the daemon (and its server) still runs");
    // A daemon that dies is started again by the next pass.
    let killed = Command::new("kill")
        .args(["-KILL", first.trim()])
        .status()
        .unwrap();
    assert!(killed.success());
    eventually("the daemon is started again", || {
        std::fs::read_to_string(&pid_file).is_ok_and(|p| p != first)
            && std::os::unix::net::UnixStream::connect(pipe.join("control")).is_ok()
    });
}

/// One `--apply --once` pass of the agent on the emulated node `node` (a NodeInventory's
/// YAML) following `pool`: what it printed, whether it succeeded, and its state directory.
fn one_pass(
    dir: &Path,
    node: &str,
    pool: &str,
    extra: &[&str],
) -> (String, bool, std::path::PathBuf) {
    let source = dir.join("pool.yaml");
    std::fs::write(&source, pool).unwrap();
    let node_file = dir.join("node.yaml");
    std::fs::write(&node_file, node).unwrap();
    let state = dir.join("state");
    let out = Command::new(BIN)
        .args(["agent", "--apply", "--once", "--source"])
        .arg(&source)
        .arg("--emulate")
        .arg(&node_file)
        .arg("--state")
        .arg(&state)
        .arg("--cache-root")
        .arg(dir.join("cache-root"))
        .args(extra)
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        out.status.success(),
        state,
    )
}

/// MPS inside a MIG instance (`mig.mps`): the A100's one 7g instance in two MPS slices, each
/// half the instance's memory and SMs, shared through a daemon of the instance's own (started
/// on its MIG device). A workload is told the MIG device, its share and its daemon; two run
/// their kernels side by side on the instance, each on half its SMs.
#[test]
fn mps_inside_a_mig_instance_shares_it_among_its_slices_side_by_side() {
    let pool = pool(2, "20Gi")
        .replace(
            "    software: {slices: 2, memory: 20Gi, compute: 50}",
            "    mig: {profiles: {7g.80gb: 1}, mps: {slices: 2}}",
        )
        .replace("limit: 25", "limit: 50");
    let node = WatchedNode::cut(pool, "300ms", "gpu0-mig0-7g.80gb-s1");
    let contract = gpuslice_contract::StateDir::new(&node.state);
    let pipe = contract.mps_pipe("gpu0-mig0-7g.80gb");
    eventually("the instance's MPS daemon listens", || {
        pipe.join("control").exists()
    });
    let config: gpuslice_contract::SliceConfig = serde_json::from_slice(
        &std::fs::read(node.state.join("slices/gpu0-mig0-7g.80gb-s1/config")).unwrap(),
    )
    .unwrap();
    assert_eq!(config.kind, gpuslice_contract::SliceKind::Mps);
    assert!(config.device_uuid.starts_with("MIG-"), "{config:?}");
    assert_eq!(config.compute_percent, 50);
    let machine = gpuslice_emulator::Store::open(&node.machine)
        .unwrap()
        .snapshot()
        .unwrap();
    let instance = machine.gpus[0]
        .instances
        .iter()
        .find(|i| i.uuid == config.device_uuid)
        .expect("the slice's MIG device is the 7g instance");
    let half_of_80g: u64 = 40 << 30;
    assert!(
        config.memory_bytes <= half_of_80g && config.memory_bytes > half_of_80g - (2 << 30),
        "half the instance's memory: {config:?}"
    );

    let told = node
        .with_driver(&mut run(
            &node.state,
            &[
                "--policy",
                "small",
                "--",
                "sh",
                "-c",
                "echo $CUDA_VISIBLE_DEVICES $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $CUDA_MPS_PIPE_DIRECTORY",
            ],
        ))
        .output()
        .unwrap();
    let told = String::from_utf8_lossy(&told.stdout);
    let words: Vec<&str> = told.split_whitespace().collect();
    assert_eq!(
        words,
        [config.device_uuid.as_str(), "50", pipe.to_str().unwrap()],
        "{told}"
    );

    let worker = format!("{BIN} bench compute-worker --kernel-us 2000 --seconds 2");
    let start = gpuslice_emulator::timeline::now_ns() + 3_000_000_000;
    let together = format!("exec {worker} --start-at {start}");
    let (a, b) = (node.run(&together, true), node.run(&together, true));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let key = gpuslice_emulator::device_key(0, Some(instance.id));
    let (a, b) = (
        kernels_on(&node.machine, key, worker_pid(&a)),
        kernels_on(&node.machine, key, worker_pid(&b)),
    );
    side_by_side_on_half_the_sms(&a, &b);
}

/// Two workers' 2 ms kernels (`a`, `b`): each ran on half the SMs (4 ms long), and most of
/// them at the same time as the other's, not taking turns.
fn side_by_side_on_half_the_sms(
    a: &[gpuslice_emulator::timeline::Interval],
    b: &[gpuslice_emulator::timeline::Interval],
) {
    assert!(
        a.len() > 100 && b.len() > 100,
        "{} and {} kernels",
        a.len(),
        b.len()
    );
    for k in a.iter().chain(b) {
        assert_eq!(k.share, 50, "every kernel on half the SMs: {k:?}");
        assert_eq!(
            k.end - k.start,
            4_000_000,
            "a 2 ms kernel takes 4 ms on half the SMs"
        );
    }
    let overlapping = a
        .iter()
        .filter(|x| b.iter().any(|y| x.start < y.end && y.start < x.end))
        .count();
    assert!(
        overlapping * 2 > a.len(),
        "side by side, not taking turns: {overlapping} of {} kernels overlap the other's",
        a.len()
    );
}

/// An `mps` layout on a GPU before Volta (a P100, compute capability 6.0, as NVML says): MPS
/// cannot hold a client to its share of the SMs there, so the agent cuts no slice and says why
/// and what to do.
#[test]
fn an_mps_layout_on_a_gpu_before_volta_is_refused_and_no_slice_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let (said, ok, state) = one_pass(
        dir.path(),
        "name: run-node\nlabels: {lab: \"yes\"}\ngpus:\n- {index: 0, model: Tesla P100-PCIE-16GB, memory: 16Gi}\n",
        &mps_pool()
            .replace("memory: 20Gi", "memory: 8Gi")
            .replace("memory: 15Gi", "memory: 6Gi"),
        &[],
    );
    assert!(!ok, "{said}");
    assert!(
        said.contains("GPU 0 (Tesla P100-PCIE-16GB) is of compute capability 6.0: MPS compute shares need 7.0 (Volta) or newer; give its pool a software layout"),
        "{said}"
    );
    assert!(
        !state.join("slices/gpu0-s0").exists(),
        "no MPS slice of the P100 is cut"
    );
    assert!(
        !gpuslice_contract::StateDir::new(&state)
            .mps("gpu0")
            .exists()
    );
}

/// An `mps` layout where the driver's MPS tool cannot run: no slice is cut without a daemon to
/// share it, and the GPU's outcome says what to install.
#[test]
fn an_mps_layout_without_the_mps_tool_cuts_no_slice_and_says_what_to_install() {
    let dir = tempfile::tempdir().unwrap();
    let (said, ok, state) = one_pass(
        dir.path(),
        "name: run-node\nlabels: {lab: \"yes\"}\ngpus:\n- {index: 0, model: NVIDIA A100-SXM4-80GB}\n",
        &mps_pool(),
        &["--mps-control", "/nonexistent/nvidia-cuda-mps-control"],
    );
    assert!(!ok, "{said}");
    assert!(
        said.contains("cannot run /nonexistent/nvidia-cuda-mps-control -d")
            && said.contains("install the driver's MPS tools"),
        "{said}"
    );
    assert!(
        !state.join("slices/gpu0-s0").exists(),
        "no MPS slice is cut"
    );
}
