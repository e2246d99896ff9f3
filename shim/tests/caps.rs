//! The shim under `LD_PRELOAD`, against the emulated driver and NVML, in C programs that reach
//! the driver in each of the three ways real programs do.

mod support;

use std::process::Command;

use gpuslice_emulator::shm::alive;
use support::{MODES, Setup, values};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

#[test]
fn the_cap_holds_for_every_kind_of_allocation_and_every_way_to_reach_the_driver() {
    let cap = 8 * GIB;
    let setup = Setup::new(cap);
    let context = cuda::CONTEXT_BYTES;
    for mode in MODES {
        let out = setup.command(&[mode, "cap"]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{mode}: {text}{err}");
        let v = values(&out);
        assert_eq!(
            v["info_total"] as u64, cap,
            "{mode}: cuMemGetInfo shows the cap\n{text}"
        );
        assert_eq!(
            v["info_free"] as u64,
            cap - context,
            "{mode}: the context is charged to the slice\n{text}"
        );
        assert_eq!(v["chunks"] as u64, (cap - context) / GIB, "{mode}\n{text}");
        assert_eq!(
            v["last_rc"], 2,
            "{mode}: the one past the cap is OUT_OF_MEMORY\n{text}"
        );
        assert_eq!(
            v["free_after"], v["info_free"],
            "{mode}: freeing gives it all back"
        );
        for kind in ["alloc", "pitch", "managed", "async", "pool", "vmm", "array"] {
            assert_eq!(
                v[&format!("{kind}_over")],
                2,
                "{mode}: {kind} past the cap\n{text}"
            );
            assert_eq!(
                v[&format!("{kind}_fit")],
                0,
                "{mode}: {kind} within the cap\n{text}"
            );
        }
        assert_eq!(
            v["free_end"], v["info_free"],
            "{mode}: nothing leaked\n{text}"
        );
        assert_eq!(
            v["nvml_total"] as u64, cap,
            "{mode}: NVML shows the cap\n{text}"
        );
        assert_eq!(
            v["nvml_used"] as u64, context,
            "{mode}: NVML shows the slice's use\n{text}"
        );
        let ledger = setup.ledger();
        ledger.reclaim(alive);
        assert_eq!(
            ledger.used(0),
            0,
            "{mode}: the process is gone, so is its memory"
        );
    }
}

#[test]
fn sixteen_processes_share_one_cap_and_the_killed_ones_give_their_memory_back() {
    // 16 processes × (a context + at most 256 MiB) fit in the cap: no allocation may fail.
    let context = cuda::CONTEXT_BYTES;
    let cap = 16 * (context + 256 * MIB);
    let setup = Setup::new(cap);
    // Every fourth process churns until it is killed; the others finish their rounds.
    let killed = |i: usize| i.is_multiple_of(4);
    let mut children: Vec<_> = (0..16)
        .map(|i| {
            let rounds = if killed(i) { "100000000" } else { "3000" };
            setup
                .command(&[MODES[i % 3], "churn", rounds, &(i + 1).to_string(), "256"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(200));
    for child in children.iter_mut().step_by(4) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "killed mid-way, not after"
        );
        child.kill().unwrap();
    }
    for (i, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        if !killed(i) {
            assert!(
                out.status.success(),
                "process {i}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(values(&out)["failures"], 0, "process {i}");
        }
    }
    // The killed processes died holding at least their contexts; a survivor whose charge did
    // not fit may already have reclaimed them (whoever notices does), so what is left is theirs
    // at most, and after a reclaim nothing is.
    let ledger = setup.ledger();
    assert!(
        ledger.used(0) <= 4 * (context + 256 * MIB),
        "only the killed processes' memory is left"
    );
    ledger.reclaim(alive);
    assert_eq!(ledger.used(0), 0, "every byte accounted for");
}

#[test]
fn a_workload_cannot_raise_its_cap() {
    let cap = 2 * GIB;
    let setup = Setup::new(cap);
    // Through the environment: it can only lower the cap.
    let out = setup
        .command(&["link", "cap"])
        .env("GPUSLICE_MEMORY_LIMIT", "100Gi")
        .output()
        .unwrap();
    assert_eq!(values(&out)["info_total"] as u64, cap);
    let out = setup
        .command(&["link", "cap"])
        .env("GPUSLICE_MEMORY_LIMIT", "1Gi")
        .output()
        .unwrap();
    assert_eq!(values(&out)["info_total"] as u64, GIB);

    // SAFETY: geteuid has no preconditions.
    if unsafe { libc_geteuid() } != 0 {
        eprintln!("not root: the checks that run the workload as another user are skipped");
        return;
    }
    let nobody = 65534;
    // The workload's user cannot rewrite its config.
    let write = Command::new("sh")
        .arg("-c")
        .arg(format!("echo '{{}}' > {}", setup.config.display()))
        .uid(nobody)
        .output()
        .unwrap();
    assert!(
        !write.status.success(),
        "the config must be read-only to the workload"
    );

    // Nor point the shim at a config of its own: that fails closed.
    let own = setup.dir.path().join("own");
    std::fs::create_dir_all(&own).unwrap();
    std::os::unix::fs::chown(&own, Some(nobody), Some(nobody)).unwrap();
    let forged = own.join("config");
    std::fs::write(&forged, r#"{"id":"x","memoryBytes":1099511627776}"#).unwrap();
    std::os::unix::fs::chown(&forged, Some(nobody), Some(nobody)).unwrap();
    let out = setup
        .command(&["link", "cap"])
        .env("GPUSLICE_SLICE_CONFIG", &forged)
        .uid(nobody)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("fail closed") && err.contains("belongs to this process's user"),
        "{err}"
    );
    // Even the context (device memory too) is refused: the program cannot start on the GPU.
    assert!(err.contains("no context"), "{err}");
    assert_eq!(out.status.code(), Some(4));

    // As that user, the real config still holds.
    let out = setup
        .command(&["link", "cap"])
        .uid(nobody)
        .output()
        .unwrap();
    assert_eq!(
        values(&out)["info_total"] as u64,
        cap,
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A node agent that accepts the connection but never answers (hung, or something else bound
/// to its socket) must not hang the program: after the handshake's timeout its launches go
/// through, ungoverned, and it says so.
#[test]
fn an_agent_that_never_answers_does_not_hang_the_program() {
    let setup = Setup::new(8 << 30);
    let socket = gpuslice_contract::StateDir::new(setup.dir.path().join("state")).socket();
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let silent = std::thread::spawn(move || listener.accept().map(|(stream, _)| stream));
    let started = std::time::Instant::now();
    let out = setup
        .command(&["link", "count", "launch", "10"])
        .output()
        .unwrap();
    let took = started.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("compute share not enforced"), "{err}");
    assert!(took < std::time::Duration::from_secs(30), "took {took:?}");
    drop(silent.join());
}

unsafe extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

use std::os::unix::process::CommandExt as _;
