//! Reconcile benchmark: one pass of the node agent over an 8 × H200 node, through the real
//! nvml-wrapper code against the emulated libnvidia-ml (every NVML call reads the shared state
//! file under its lock, as separate processes would). Three passes: nothing to do (the steady
//! state a service repeats every interval), a fresh node to a 4-instance MIG layout per GPU, and
//! a window change to whole GPUs. And the watchdog's read (every GPU's compute processes with
//! their memory and their SM use, as the agent takes it once per `--memory-watchdog-interval`, 1 s
//! by default) with 16 processes holding memory and running kernels on each GPU. Prints a table; exits non-zero on FAIL.
//!
//!     cargo bench -p gpuslice-node --bench reconcile
//!
//! On real hardware a MIG create or destroy takes the driver tens to hundreds of milliseconds,
//! which dominates the transitions; the steady pass is what the agent costs a node.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpuslice_contract::StateDir;
use gpuslice_emulator::{Machine, Store};
use gpuslice_node::{NvmlGpus, converge_to as converge};
use gpuslice_planning::transition::Desired;

const GPUS: u32 = 8;
const RUNS: usize = 15;

fn mig(pairs: &[(&str, u32)]) -> Vec<(u32, Desired)> {
    let counts: BTreeMap<String, u32> = pairs.iter().map(|(p, n)| (p.to_string(), *n)).collect();
    (0..GPUS)
        .map(|i| (i, Desired::Mig(counts.clone())))
        .collect()
}

fn fresh() -> Machine {
    let gpus: String = (0..GPUS)
        .map(|i| format!("- {{index: {i}, model: NVIDIA H200}}\n"))
        .collect();
    let node: gpuslice_api::NodeInventory =
        serde_yaml::from_str(&format!("name: bench\ngpus:\n{gpus}")).unwrap();
    Machine::from_inventory(&node).unwrap()
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// Times `pass` from the state `setup` leaves, `RUNS` times.
fn time(
    run: &StateDir,
    gpus: &NvmlGpus,
    setup: impl Fn(),
    desired: &[(u32, Desired)],
) -> (Duration, usize) {
    let mut samples = Vec::new();
    let mut ops = 0;
    for _ in 0..RUNS {
        setup();
        let _ = std::fs::remove_dir_all(run.root());
        let start = Instant::now();
        let outcomes = converge(gpus, "bench", run, desired, &[], true).unwrap();
        samples.push(start.elapsed());
        assert!(outcomes.iter().all(|o| o.converged), "{outcomes:?}");
        ops = outcomes.iter().map(|o| o.ops.len()).sum();
    }
    (median(samples), ops)
}

/// Times the watchdog's NVML read with 16 live processes holding memory on every GPU (rows of
/// the CUDA emulator's ledger, which the emulated NVML lists) and each running 50 kernels of
/// 1 ms there (records on the GPU's timeline, which its per-process utilisation is read from).
/// Returns the median and how many processes one read saw.
fn watchdog_read(state: &std::path::Path, gpus: &NvmlGpus) -> (Duration, usize) {
    use gpuslice_emulator::shm::{Ledger, Process, start_time};
    let ledger = Ledger::open(&gpuslice_emulator::cuda_ledger_path(state)).unwrap();
    let mut children: Vec<std::process::Child> = (0..16)
        .map(|_| {
            std::process::Command::new("sleep")
                .arg("600")
                .spawn()
                .unwrap()
        })
        .collect();
    for child in &children {
        let process = Process {
            pid: child.id(),
            start: start_time(child.id()).unwrap_or(0),
            pidns: gpuslice_emulator::shm::pid_namespace("self").unwrap_or(0),
        };
        for gpu in 0..GPUS {
            let row = ledger
                .row_for(process, gpuslice_emulator::device_key(gpu, None))
                .unwrap();
            ledger.charge(row, 1 << 30);
            let key = gpuslice_emulator::device_key(gpu, None);
            let timeline = gpuslice_emulator::timeline::Timeline::open(
                &gpuslice_emulator::timeline::timeline_path(state, key),
            )
            .unwrap();
            let mut end = gpuslice_emulator::timeline::now_ns();
            for _ in 0..50 {
                end = timeline.run(child.id(), end, 1_000_000);
            }
        }
    }
    let mut since = std::collections::BTreeMap::new();
    let mut used = 0;
    let mut samples = Vec::new();
    let mut seen = 0;
    for _ in 0..RUNS {
        let start = Instant::now();
        let processes = gpus.compute_processes();
        let uses = gpus.process_utilization(&(0..GPUS).collect(), &mut since);
        samples.push(start.elapsed());
        used = used.max(uses.len());
        seen = processes.len();
    }
    for child in &mut children {
        let _ = child.kill();
        let _ = child.wait();
    }
    ledger.reclaim(gpuslice_emulator::shm::alive);
    assert_eq!(
        seen,
        16 * GPUS as usize,
        "NVML lists every process on every GPU"
    );
    assert!(
        used > 0,
        "NVML reports the SM use of processes that ran kernels"
    );
    (median(samples), seen)
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("gpus.json");
    let run = StateDir::new(dir.path().join("run"));
    let store = Store::create(&state, &fresh()).unwrap();
    // SAFETY: set before NVML is loaded and before any other thread exists.
    unsafe { std::env::set_var(gpuslice_contract::env::EMULATOR_STATE, &state) };
    let gpus = NvmlGpus::open(Some(&gpuslice_emulator::built_library("libnvidia_ml.so"))).unwrap();

    // On whole GPUs, where software slices and so the compute watchdog's reads are (MIG mode
    // reports no per-process use).
    let watchdog = watchdog_read(&state, &gpus);

    let day = mig(&[("3g.71gb", 1), ("2g.35gb", 1), ("1g.18gb", 2)]);
    let night = mig(&[("7g.141gb", 1)]);
    let reset = |m: &Machine| Store::create(&state, m).unwrap();
    converge(&gpus, "bench", &run, &day, &[], true).unwrap();
    let day_state = store.snapshot().unwrap();
    let mut rows = vec![
        (
            "steady (nothing to do)",
            time(
                &run,
                &gpus,
                || {
                    reset(&day_state);
                },
                &day,
            ),
            Duration::from_millis(100),
        ),
        (
            "fresh → MIG layout",
            time(
                &run,
                &gpus,
                || {
                    reset(&fresh());
                },
                &day,
            ),
            Duration::from_millis(1000),
        ),
        (
            "window change → whole GPUs",
            time(
                &run,
                &gpus,
                || {
                    reset(&day_state);
                },
                &night,
            ),
            Duration::from_millis(1000),
        ),
    ];
    // The watchdog reads every second what a pass reads every interval (30 s by default): one
    // read must cost no more than the steady pass, measured here in the same run (two NVML calls
    // per GPU: its handle and its process list).
    let steady = rows[0].1.0;
    rows.insert(0, ("watchdog read (128 procs)", watchdog, steady));
    println!(
        "{:<28} {:>5} {:>12} {:>10}  result",
        "8 × H200", "ops", "median", "target"
    );
    let mut failed = false;
    for (name, (took, ops), target) in rows {
        let ok = took <= target;
        failed |= !ok;
        println!(
            "{name:<28} {ops:>5} {:>10.1}ms {:>8}ms  {}",
            took.as_secs_f64() * 1e3,
            target.as_millis(),
            if ok { "PASS" } else { "FAIL" }
        );
    }
    if failed {
        std::process::exit(1);
    }
}
