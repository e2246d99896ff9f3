//! Compute shares with real processes: `gpuslice` workers under the shim, on the emulated GPU,
//! arbitrated by the agent's arbiter over its socket. Shares come from the emulator's timeline.
//! Bounds are wide (an ungoverned process takes ~100 % of the GPU): these tests prove the
//! mechanism governs each path; `gpuslice bench compute` measures how precisely.

use std::path::Path;
use std::time::{Duration, Instant};

use gpuslice_bench::compute::{Bench, Scenario, SliceSpec, Work, slice_id};
use gpuslice_node::workloads::arbiter::Share;

fn exe() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_gpuslice"))
}

fn alone(name: &'static str, percent: u32, work: Work, processes: usize) -> Scenario {
    Scenario {
        name,
        time_slice_ms: 10,
        slices: vec![SliceSpec {
            name: "a",
            share: Share::capped(percent),
            processes,
            work,
            target: f64::from(percent),
        }],
    }
}

#[test]
fn graphs_cooperative_and_ex_launches_are_all_held_to_the_cap() {
    let scenarios = vec![
        alone("graph", 20, Work::Graph, 1),
        alone("cooperative", 20, Work::Cooperative, 1),
        alone("ex", 20, Work::LaunchEx, 1),
        alone("plain", 20, Work::Busy, 1),
    ];
    let bench = Bench::new(exe(), &scenarios).unwrap();
    for (i, scenario) in scenarios.iter().enumerate() {
        let result = bench.run(i, scenario, 2).unwrap();
        let share = result.slices[0].overall;
        // Ungoverned, a busy process alone has the whole GPU.
        assert!(
            share > 5.0 && share < 35.0,
            "{}: a slice capped at 20 % had {share:.1} % of the GPU",
            scenario.name
        );
    }
}

#[test]
fn the_processes_of_one_slice_share_one_budget() {
    let scenarios = vec![alone("three processes", 30, Work::Busy, 3)];
    let bench = Bench::new(exe(), &scenarios).unwrap();
    let started = gpuslice_emulator::timeline::now_ns();
    let result = bench.run(0, &scenarios[0], 2).unwrap();
    let share = result.slices[0].overall;
    assert!(
        share < 45.0,
        "three processes of a slice capped at 30 % had {share:.1} % together"
    );
    // Each of them ran: the budget is shared, not taken by one.
    let mut pids: Vec<u32> = bench
        .intervals()
        .unwrap()
        .iter()
        .filter(|i| i.start >= started)
        .map(|i| i.pid)
        .collect();
    pids.sort();
    pids.dedup();
    assert_eq!(pids.len(), 3, "every process ran kernels");
}

#[test]
fn a_process_killed_while_holding_the_gpu_does_not_stall_the_others() {
    let best_effort = |name| SliceSpec {
        name,
        share: Share {
            weight: 50,
            limit: 100,
            guarantee: 0,
        },
        processes: 1,
        work: Work::Busy,
        target: 50.0,
    };
    let scenario = Scenario {
        name: "kill",
        time_slice_ms: 10,
        slices: vec![best_effort("victim"), best_effort("other")],
    };
    let bench = Bench::new(exe(), std::slice::from_ref(&scenario)).unwrap();
    bench.activate(0, &scenario);
    let args = ["--kernel-us", "500", "--seconds", "6"].map(String::from);
    let mut victim = bench.worker(&slice_id(0, "victim"), &args).unwrap();
    let other = bench.worker(&slice_id(0, "other"), &args).unwrap();
    let (victim_pid, other_pid) = (victim.id(), other.id());
    // Kill the victim while it holds the GPU: its last kernel is its own, the newest on record.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        std::thread::sleep(Duration::from_millis(3));
        let last = bench.intervals().unwrap().last().map(|i| i.pid);
        if last == Some(victim_pid) {
            break;
        }
        assert!(Instant::now() < deadline, "the victim never got the GPU");
    }
    victim.kill().unwrap();
    let killed = gpuslice_emulator::timeline::now_ns();
    victim.wait().unwrap();
    let out = other.wait_with_output().unwrap();
    assert!(out.status.success(), "the other worker failed");
    // After the kill the other slice has the GPU to itself.
    let second = 1_000_000_000;
    let from = killed + second / 2;
    let busy: u64 = bench
        .intervals()
        .unwrap()
        .iter()
        .filter(|i| i.pid == other_pid && i.start >= from)
        .map(|i| i.end - i.start)
        .sum();
    let last_end = bench
        .intervals()
        .unwrap()
        .iter()
        .filter(|i| i.pid == other_pid)
        .map(|i| i.end)
        .max()
        .unwrap();
    let share = busy as f64 / (last_end - from) as f64 * 100.0;
    assert!(
        share > 80.0,
        "after the holder was killed the other slice had {share:.1} % of the GPU"
    );
}

/// The benchmark as a person runs it (one short scenario): it prints its table, one row per
/// slice, with a verdict on each.
#[test]
fn the_benchmark_prints_target_and_achieved_share_per_slice() {
    let out = std::process::Command::new(exe())
        .args(["bench", "compute", "--scenario", "4 x 25", "--seconds", "2"])
        .arg("--no-overhead")
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| l.ends_with("PASS") || l.ends_with("FAIL"))
        .collect();
    assert_eq!(
        rows.len(),
        4,
        "a row per slice:\n{table}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(rows[0].starts_with("4 x 25"), "{table}");
    // The exit status is the verdict.
    assert_eq!(
        out.status.success(),
        rows.iter().all(|r| r.ends_with("PASS"))
    );
}

/// On a real GPU there is no timeline: shares are measured from when each worker's steps
/// finished. That method, applied on the emulator, must agree with the timeline.
#[test]
fn shares_from_completed_kernels_agree_with_the_timeline() {
    use gpuslice_bench::compute::{KERNEL_US, shares};
    let capped = |name, percent: u32| SliceSpec {
        name,
        share: Share::capped(percent),
        processes: 1,
        work: Work::Busy,
        target: f64::from(percent),
    };
    let scenario = Scenario {
        name: "30/60",
        time_slice_ms: 10,
        slices: vec![capped("a", 30), capped("b", 60)],
    };
    let bench = Bench::new(exe(), std::slice::from_ref(&scenario)).unwrap();
    let result = bench.run(0, &scenario, 3).unwrap();
    for slice in &result.slices {
        let id = slice_id(0, &slice.name);
        let completed: Vec<_> = result
            .reports
            .iter()
            .filter(|(of, _)| *of == id)
            .flat_map(|(_, r)| r.intervals(KERNEL_US * 1000))
            .collect();
        let (windows, overall) = shares(&completed, result.start_ns, 3);
        for (w, (from_timeline, from_completions)) in slice.windows.iter().zip(&windows).enumerate()
        {
            assert!(
                (from_timeline - from_completions).abs() < 1.5,
                "slice {} window {w}: timeline {from_timeline:.1} %, completed kernels {from_completions:.1} %",
                slice.name
            );
        }
        assert!(
            (slice.overall - overall).abs() < 1.0,
            "slice {}: timeline {:.1} %, completed kernels {overall:.1} %",
            slice.name,
            slice.overall
        );
    }
}
