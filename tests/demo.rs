//! `gpuslice demo`, run as the README says and followed as a new user would: the commands it
//! prints are run as printed (through its env.sh: its KUBECONFIG and kubectl), and what they show
//! is what the hints promise: a labelled pod gets a slice, a waiting pod says where it stands in
//! the queue, a preemption completes, the window changes, an elastic pool re-cuts a GPU for
//! waiting pods. Ctrl-C removes everything.

use std::io::BufRead as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The demo's printed steps: each step's commands (the lines after `  $ `).
fn steps(hints: &str) -> Vec<Vec<String>> {
    let mut steps: Vec<Vec<String>> = Vec::new();
    for line in hints.lines() {
        if line.chars().next().is_some_and(|c| c.is_ascii_digit()) && line.contains(". ") {
            steps.push(Vec::new());
        } else if let (Some(command), Some(step)) = (line.strip_prefix("  $ "), steps.last_mut()) {
            step.push(command.to_string());
        }
    }
    steps
}

/// Runs a printed command in bash after sourcing the demo's env.sh, as the hints say to.
fn run(env: &Path, command: &str) -> String {
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!("source {} && {command}", env.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "`{command}` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `command` until `check` accepts its output (two minutes at most).
fn until(env: &Path, what: &str, command: &str, check: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let out = run(env, command);
        if check(&out) {
            return out;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not happen; `{command}` shows:\n{out}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The rows of a kubectl table whose first columns are `cells`.
fn row<'a>(table: &'a str, cells: &[&str]) -> Option<Vec<&'a str>> {
    table
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|r| r.starts_with(cells))
}

#[test]
fn the_demo_shows_a_slice_the_queue_a_preemption_a_window_change_and_an_elastic_re_cut() {
    if gpuslice_testcluster::locate_binaries().is_err() && std::env::var_os("CI").is_none() {
        eprintln!("SKIPPED: run `bash tests/controlplane/build.sh` once to try the demo");
        return;
    }
    if gpuslice_testcluster::built_tool("GPUSLICE_HELM", "helm", "").is_none() {
        return;
    }
    let mut demo = gpuslice_testcluster::KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_gpuslice"))
            // The first window change 90 s after the start: time for the first two steps.
            .args(["demo", "--window-in", "90s"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let stdout = demo.0.stdout.take().unwrap();
    let (lines, printed) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = lines.send(line);
        }
    });
    let mut hints = String::new();
    while !hints.contains("Ctrl-C stops everything") {
        let line = printed
            .recv_timeout(Duration::from_secs(180))
            .expect("the demo prints its hints within 3 minutes");
        hints.push_str(&line);
        hints.push('\n');
    }
    println!("{hints}");
    let env: PathBuf = hints
        .lines()
        .find_map(|l| l.trim().strip_prefix("source "))
        .and_then(|l| l.split_whitespace().next())
        .expect("the hints say what to source")
        .into();
    let dir = env.parent().unwrap().to_path_buf();
    let steps = steps(&hints);
    assert_eq!(
        steps.iter().map(Vec::len).collect::<Vec<_>>(),
        [3, 3, 4, 2, 3],
        "five steps: {steps:?}"
    );
    assert!(
        run(&env, "kubectl version").contains("Server Version: v1.36"),
        "env.sh puts a kubectl of the server's version first on PATH"
    );

    // 1. Five notebooks for four slices: four run on a100-0, the fifth waits, told its place.
    run(&env, &steps[0][0]);
    until(&env, "four notebooks on a100-0", &steps[0][1], |pods| {
        let running = (1..=5)
            .filter(|i| {
                row(pods, &[&format!("notebook-{i}"), "1/1", "Running"])
                    .is_some_and(|r| r.contains(&"a100-0"))
            })
            .count();
        running == 4 && row(pods, &["notebook-5", "0/1", "SchedulingGated"]).is_some()
    });
    let queued = until(&env, "notebook-5 told its place", &steps[0][2], |m| {
        !m.trim().is_empty()
    });
    assert_eq!(
        queued.trim(),
        "1st of 1 waiting in the queue of pool shared-a100: no free slice of pool shared-a100 fits policy notebook"
    );

    // 2. The fine-tune takes a notebook's slice: that notebook is preempted (evicted at once:
    //    nothing ran on a fake node to checkpoint).
    run(&env, &steps[1][0]);
    until(&env, "bert-1 running on a100-0", &steps[1][1], |pods| {
        let notebooks = pods.lines().filter(|l| l.contains("notebook-")).count();
        row(pods, &["nlp", "bert-1", "1/1", "Running"]).is_some_and(|r| r.contains(&"a100-0"))
            && notebooks == 4
    });
    let preempted = until(&env, "a Preempted event", &steps[1][2], |e| {
        e.contains("Preempted")
    });
    assert!(preempted.contains("evicted by gpuslice"), "{preempted}");

    // 3. The window change: the pool shows window night and two slices, the node publishes two
    //    devices, and no pod is left on a slice that was re-cut.
    let pools = until(
        &env,
        "pool shared-a100 in window night",
        &steps[2][0],
        |t| row(t, &["shared-a100"]).is_some_and(|r| r.contains(&"night")),
    );
    assert_eq!(
        row(&pools, &["shared-a100"]).unwrap()[..4],
        ["shared-a100", "1", "1", "2"],
        "{pools}"
    );
    until(&env, "a100-0 publishing two slices", &steps[2][1], |t| {
        row(t, &["a100-0"]).is_some_and(|r| r[1] == "gpu0-s0,gpu0-s1")
    });
    let resliced = until(
        &env,
        "pods evicted from the old slices",
        &steps[2][2],
        |t| t.contains("re-cut for a new layout"),
    );
    assert!(resliced.contains("Resliced"), "{resliced}");
    until(
        &env,
        "at most two tenant pods on a100-0",
        "kubectl get pods -A -o wide --field-selector spec.nodeName=a100-0 -l gpuslice.io/policy",
        |t| t.lines().skip(1).count() <= 2,
    );
    let nodes = run(&env, &steps[2][3]);
    assert!(
        row(&nodes, &["a100-0", "1"]).is_some_and(|r| r.contains(&"True")),
        "{nodes}"
    );

    // 4. A MIG slice on the H200.
    run(&env, &steps[3][0]);
    until(
        &env,
        "the inference pod's claim allocated",
        &steps[3][1],
        |t| t.contains("allocated"),
    );

    // 5. The elastic pool: h100-0's idle GPU is cut from halves into quarters for the six
    //    notebooks; four run there, two wait.
    run(&env, &steps[4][0]);
    until(
        &env,
        "four research notebooks on h100-0",
        &steps[4][1],
        |pods| {
            let on_h100 = (1..=6)
                .filter(|i| {
                    row(pods, &[&format!("research-{i}"), "1/1", "Running"])
                        .is_some_and(|r| r.contains(&"h100-0"))
                })
                .count();
            let gated = pods
                .lines()
                .filter(|l| l.contains("SchedulingGated"))
                .count();
            on_h100 == 4 && gated == 2
        },
    );
    let recut = run(&env, &steps[4][2]);
    assert!(
        recut.contains("halves → quarters") && recut.contains("research-notebook"),
        "{recut}"
    );

    // Ctrl-C: everything stops and the demo's folder is gone.
    let interrupted = Command::new("kill")
        .args(["-INT", &demo.0.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupted.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = demo.0.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the demo did not stop on Ctrl-C");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(status.success(), "{status}");
    assert!(!dir.exists(), "{} is left behind", dir.display());
}
