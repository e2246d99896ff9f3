//! `gpuslice agent` as a service, against emulated nodes: it follows a real Git repository
//! (new commits, bad commits, force-pushes, a remote that disappears), switches layouts at a
//! window boundary without a restart, and drains busy instances as their CheckpointPolicy says.
//! Each test reads the agent's passes (one JSON line each) until what it waits for shows up.

use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use gpuslice_emulator::{Machine, Store};
use gpuslice_testcluster::repo_root as root;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_gpuslice");
/// Only a guard against a hung test; nothing here asserts how fast the agent is.
const PATIENCE: Duration = Duration::from_secs(120);

/// A running agent; killed when dropped.
struct Agent {
    child: Child,
    passes: Receiver<Value>,
    seen: Vec<Value>,
}

impl Agent {
    fn start(
        args: &[&str],
        source: &Path,
        node: &Path,
        state: &Path,
        env: &[(&str, &str)],
    ) -> Agent {
        let interval: &[&str] = if args.contains(&"--interval") {
            &[]
        } else {
            &["--interval", "1s"]
        };
        let mut child = Command::new(BIN)
            .args(["agent", "--apply", "--output", "json", "--source"])
            .arg(source)
            .arg("--emulate")
            .arg(node)
            .arg("--state")
            .arg(state)
            // Pools' dataset caches, for /var/lib/gpuslice/cache.
            .arg("--cache-root")
            .arg(std::path::Path::new(&state).join("caches"))
            .args(args)
            .args(interval)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, passes) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Ok(v) = serde_json::from_str(&line) {
                    if tx.send(v).is_err() {
                        break;
                    }
                }
            }
        });
        Agent {
            child,
            passes,
            seen: Vec::new(),
        }
    }

    /// The first pass from now on for which `want` holds.
    fn wait_for(&mut self, what: &str, want: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.passes.recv_timeout(left) {
                Ok(pass) => {
                    let hit = want(&pass);
                    self.seen.push(pass.clone());
                    if hit {
                        return pass;
                    }
                }
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => panic!(
                    "no pass where {what}; the last was:\n{}",
                    self.seen
                        .last()
                        .map(|p| serde_json::to_string_pretty(p).unwrap())
                        .unwrap_or_default()
                ),
            }
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn gpu0(pass: &Value) -> &Value {
    &pass["outcomes"][0]
}

fn converged(pass: &Value) -> bool {
    gpu0(pass)["converged"] == true && gpu0(pass)["ops"].as_array().is_some_and(Vec::is_empty)
}

fn node_file(dir: &Path, yaml: &str) -> PathBuf {
    let path = dir.join("node.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

fn machine(state: &Path, node: &str) -> Machine {
    Store::open(&state.join(format!("emulated-{node}.json")))
        .unwrap()
        .snapshot()
        .unwrap()
}

/// Instances on GPU 0 as (profile id, start, size, UUID), sorted.
fn instances(m: &Machine) -> Vec<(u32, u32, u32, String)> {
    let mut out: Vec<_> = m
        .gpu(0)
        .unwrap()
        .instances
        .iter()
        .map(|i| {
            (
                i.profile_id,
                i.placement.start,
                i.placement.size,
                i.uuid.clone(),
            )
        })
        .collect();
    out.sort();
    out
}

fn pool(profiles: &str) -> String {
    format!(
        "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata:\n  name: lab\nspec:\n  nodeSelector:\n    matchLabels: {{lab: \"yes\"}}\n  layout:\n    mig:\n      profiles: {{{profiles}}}\n"
    )
}

/// Commits `pool.yaml` with `text` on top of `parent` and moves the checked-out branch there,
/// rewriting history when `parent` is not the branch's tip (what a force-push does).
fn commit(repo: &git2::Repository, text: &str, parent: Option<git2::Oid>) -> git2::Oid {
    std::fs::write(repo.workdir().unwrap().join("pool.yaml"), text).unwrap();
    let mut index = repo.index().unwrap();
    index.add_path(Path::new("pool.yaml")).unwrap();
    index.write().unwrap();
    let tree = repo.find_tree(index.write_tree().unwrap()).unwrap();
    let sig = git2::Signature::now("platform team", "platform@example.com").unwrap();
    let parents: Vec<git2::Commit> = parent
        .map(|p| repo.find_commit(p).unwrap())
        .into_iter()
        .collect();
    let parents: Vec<&git2::Commit> = parents.iter().collect();
    let oid = repo
        .commit(None, &sig, &sig, "pool", &tree, &parents)
        .unwrap();
    repo.reference("refs/heads/main", oid, true, "test")
        .unwrap();
    oid
}

const LAB_NODE: &str =
    "name: lab-node\nlabels: {lab: \"yes\"}\ngpus:\n- {index: 0, model: NVIDIA H200}\n";

#[test]
fn the_agent_follows_git_through_bad_commits_force_pushes_and_a_lost_remote() {
    let dir = tempfile::tempdir().unwrap();
    let origin = dir.path().join("gitops");
    let repo = git2::Repository::init(&origin).unwrap();
    repo.set_head("refs/heads/main").unwrap();
    let node = node_file(dir.path(), LAB_NODE);
    let state = dir.path().join("state");
    let first = commit(&repo, &pool("3g.71gb: 2"), None);

    let mut agent = Agent::start(&["--ref", "main"], &origin, &node, &state, &[]);
    let rev = |oid: git2::Oid| Value::String(oid.to_string());
    agent.wait_for("the first commit is applied", |p| {
        p["revision"] == rev(first) && converged(p)
    });
    assert_eq!(instances(&machine(&state, "lab-node")).len(), 2);

    let second = commit(&repo, &pool("3g.71gb: 1, 1g.18gb: 4"), Some(first));
    agent.wait_for("a new commit is applied", |p| {
        p["revision"] == rev(second) && converged(p)
    });
    let good = instances(&machine(&state, "lab-node"));
    assert_eq!(good.len(), 5);

    let bad = commit(&repo, &pool("5g.99gb: 1"), Some(second));
    let pass = agent.wait_for("the bad commit is rejected", |p| {
        p["source"]["rejected"] == rev(bad)
    });
    assert_eq!(
        pass["revision"],
        rev(second),
        "the last good commit stays in force"
    );
    let problems = pass["source"]["problems"].to_string();
    assert!(
        problems.contains("pool.yaml:9: GpuPool/lab: spec.layout.mig"),
        "{problems}"
    );
    assert_eq!(
        instances(&machine(&state, "lab-node")),
        good,
        "nothing changed"
    );

    // Force-push: main moves back onto the first commit's history.
    let rewritten = commit(&repo, &pool("7g.141gb: 1"), Some(first));
    agent.wait_for("the force-pushed commit is applied", |p| {
        p["revision"] == rev(rewritten) && converged(p) && p["source"]["problems"].is_null()
    });
    let whole = instances(&machine(&state, "lab-node"));
    assert_eq!(whole.len(), 1);

    drop(repo);
    std::fs::remove_dir_all(&origin).unwrap();
    let pass = agent.wait_for("the lost remote is noticed", |p| {
        !p["source"]["warning"].is_null()
    });
    assert_eq!(pass["revision"], rev(rewritten));
    assert!(
        pass["source"]["warning"]
            .as_str()
            .unwrap()
            .contains("keeping commit")
    );
    drop(agent);

    // A restart without the remote still has the last fetched commit.
    let mut agent = Agent::start(&["--ref", "main"], &origin, &node, &state, &[]);
    let pass = agent.wait_for("the restarted agent reports", |_| true);
    assert_eq!(pass["revision"], rev(rewritten));
    assert!(converged(&pass));
    assert_eq!(instances(&machine(&state, "lab-node")), whole);
}

#[test]
fn the_agent_switches_layouts_at_a_window_boundary_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let node = node_file(
        dir.path(),
        "name: boundary-node\nlabels: {gpuslice.io/pool: h200-mig}\ngpus:\n- {index: 0, model: NVIDIA H200}\n",
    );
    // 21:59:57 in Berlin on a Wednesday: three seconds before the night window. The interval is
    // an hour, so only the boundary can wake the agent.
    let mut agent = Agent::start(
        &["--interval", "1h"],
        &root().join("examples/gitops"),
        &node,
        dir.path(),
        &[("GPUSLICE_CLOCK_START", "2026-12-02T20:59:57Z")],
    );
    let day = agent.wait_for("the day layout is applied", |p| {
        gpu0(p)["converged"] == true
    });
    assert_eq!(day["plan"]["pools"][0]["window"], Value::Null);
    assert_eq!(instances(&machine(dir.path(), "boundary-node")).len(), 4);
    let night = agent.wait_for("the night layout is applied", |p| {
        p["plan"]["pools"][0]["window"] == "night" && gpu0(p)["converged"] == true
    });
    assert!(night["plan"]["at"].as_str().unwrap() >= "2026-12-02T21:00:00");
    let whole = instances(&machine(dir.path(), "boundary-node"));
    assert_eq!(whole.len(), 1);
    assert_eq!(whole[0].2, 8, "one instance of all eight memory slices");
}

/// A node whose GPU has one busy 3g instance, in a pool that wants the whole GPU, with a
/// checkpoint policy; a real process (a shell) runs on the instance. It holds no claim (it
/// was put there directly, as work started before the agent was), so the agent runs with
/// `--stray-processes report`: what is tested is how a re-cut drains it.
struct Draining {
    dir: tempfile::TempDir,
    node: PathBuf,
    source: PathBuf,
    workload: Child,
}

impl Draining {
    fn new(policy: &str, script: &str) -> Draining {
        let dir = tempfile::tempdir().unwrap();
        let node = node_file(
            dir.path(),
            "name: busy-node\nlabels: {lab: \"yes\"}\ngpus:\n- index: 0\n  model: NVIDIA H200\n  mig:\n    enabled: true\n    instances:\n    - {profile: 3g.71gb, placement: {start: 0, size: 4}}\n",
        );
        let source = dir.path().join("gitops");
        std::fs::create_dir_all(&source).unwrap();
        let pool = pool("7g.141gb: 1").replace("spec:\n", "spec:\n  checkpointPolicy: ckpt\n");
        std::fs::write(source.join("pool.yaml"), pool).unwrap();
        std::fs::write(
            source.join("checkpoint.yaml"),
            format!("apiVersion: gpuslice.io/v1alpha1\nkind: CheckpointPolicy\nmetadata:\n  name: ckpt\nspec:\n{policy}"),
        )
        .unwrap();
        let inventory = serde_yaml::from_str(&std::fs::read_to_string(&node).unwrap()).unwrap();
        let mut machine = Machine::from_inventory(&inventory).unwrap();
        let marker = dir.path().join("slices/gpu0-mig0-3g.71gb/checkpoint-done");
        let workload = Command::new("sh")
            .arg("-c")
            .arg(script)
            .env("MARKER", &marker)
            .spawn()
            .unwrap();
        let gi = machine.gpu(0).unwrap().instances[0].id;
        machine
            .attach_real_process(0, workload.id(), 8 << 30, Some(gi))
            .unwrap();
        Store::create(&dir.path().join("emulated-busy-node.json"), &machine).unwrap();
        Draining {
            dir,
            node,
            source,
            workload,
        }
    }

    fn start(&self) -> Agent {
        Agent::start(
            &["--stray-processes", "report"],
            &self.source,
            &self.node,
            self.dir.path(),
            &[],
        )
    }

    fn alive(&mut self) -> bool {
        self.workload.try_wait().unwrap().is_none()
    }
}

impl Drop for Draining {
    fn drop(&mut self) {
        let _ = self.workload.kill();
        let _ = self.workload.wait();
    }
}

fn blocked_on(pass: &Value, reason: &str) -> bool {
    pass["draining"].as_array().is_some_and(|d| {
        d.iter()
            .any(|w| w["reason"].as_str().unwrap_or("").contains(reason))
    })
}

#[test]
fn a_workload_that_checkpoints_is_stopped_and_the_transition_completes() {
    // The workload checkpoints when told (writes the marker) but does not exit by itself.
    let mut busy = Draining::new(
        "  signal: SIGUSR1\n  gracePeriod: 1h\n  required: true\n",
        "trap 'touch \"$MARKER\"' USR1; while :; do sleep 0.1; done",
    );
    let mut agent = busy.start();
    let first = agent.wait_for("the transition is blocked", |p| {
        !gpu0(p)["blockedBy"].as_array().unwrap().is_empty()
    });
    assert_eq!(gpu0(&first)["blocking"][0]["slice"], "gpu0-mig0-3g.71gb");
    agent.wait_for("the whole GPU is made", converged);
    assert!(!busy.alive(), "stopped after its checkpoint");
    let m = machine(busy.dir.path(), "busy-node");
    assert_eq!(instances(&m).len(), 1);
    assert_eq!(instances(&m)[0].2, 8);
    let seen = agent
        .seen
        .iter()
        .any(|p| blocked_on(p, "sent SIGUSR1 (ckpt)"));
    assert!(seen, "the agent reported the signal");
}

#[test]
fn a_workload_that_ignores_the_signal_is_stopped_after_the_grace_period() {
    let mut busy = Draining::new(
        "  signal: SIGUSR2\n  gracePeriod: 2s\n  required: false\n",
        "trap '' USR2; while :; do sleep 0.1; done",
    );
    let mut agent = busy.start();
    agent.wait_for("the whole GPU is made", converged);
    assert!(!busy.alive());
    assert!(agent.seen.iter().any(|p| blocked_on(p, "sent SIGUSR2")));
}

#[test]
fn a_required_checkpoint_keeps_the_transition_waiting_until_the_workload_exits() {
    let mut busy = Draining::new(
        "  signal: SIGUSR1\n  gracePeriod: 1s\n  required: true\n",
        "trap '' USR1; while :; do sleep 0.1; done",
    );
    let mut agent = busy.start();
    let pass = agent.wait_for("the agent waits past the grace period", |p| {
        blocked_on(p, "requires a checkpoint")
    });
    assert_eq!(gpu0(&pass)["converged"], false);
    // Two more passes: still waiting, the workload still running, nothing destroyed.
    agent.wait_for("another pass", |_| true);
    let pass = agent.wait_for("another pass", |_| true);
    assert!(blocked_on(&pass, "requires a checkpoint"));
    assert!(
        busy.alive(),
        "a required checkpoint never stops the workload"
    );
    assert_eq!(instances(&machine(busy.dir.path(), "busy-node")).len(), 1);
    assert_eq!(instances(&machine(busy.dir.path(), "busy-node"))[0].2, 4);

    // It finishes on its own; the transition goes ahead.
    busy.workload.kill().unwrap();
    busy.workload.wait().unwrap();
    agent.wait_for("the whole GPU is made", converged);
}
