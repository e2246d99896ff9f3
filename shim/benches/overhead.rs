//! What the shim costs a CUDA program per call, against the emulated driver: the probe program
//! runs each call in a loop without the shim and with it (capped slice), and reports the median
//! nanoseconds per call and, under valgrind's callgrind, the instructions per call (the
//! difference between two loop lengths, so start-up does not count). Prints a table; exits
//! non-zero on FAIL. Targets: a launch passes through within 1.1× of no shim; the accounting on
//! an allocation (cuMemAlloc + cuMemFree, with shim minus without) stays under 100 ns.
//!
//!     cargo bench -p gpuslice-shim --bench overhead

#[path = "../tests/support/mod.rs"]
mod support;

use std::process::Command;

use support::{Setup, numbers};

const CALLS: &str = "200000";

fn timed(setup: &Setup, shim: bool) -> std::collections::HashMap<String, f64> {
    let mut cmd = setup.command(&["link", "bench", CALLS]);
    if !shim {
        cmd.env_remove("LD_PRELOAD")
            .env_remove("GPUSLICE_SLICE_CONFIG");
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    numbers(&out)
}

/// Instructions per call of `op`, or `None` without valgrind.
fn instructions(setup: &Setup, shim: bool, op: &str) -> Option<f64> {
    let run = |n: u64| -> Option<f64> {
        let file = setup.dir.path().join(format!("callgrind.{op}.{shim}.{n}"));
        let mut cmd = Command::new("valgrind");
        cmd.arg("--tool=callgrind")
            .arg(format!("--callgrind-out-file={}", file.display()))
            .arg(&setup.probe)
            .args(["link", "count", op, &n.to_string()])
            .envs(
                setup
                    .command(&[])
                    .get_envs()
                    .filter_map(|(k, v)| Some((k, v?))),
            );
        if !shim {
            cmd.env_remove("LD_PRELOAD")
                .env_remove("GPUSLICE_SLICE_CONFIG");
        }
        let out = cmd.output().ok()?;
        if !out.status.success() {
            return None;
        }
        let text = std::fs::read_to_string(&file).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("summary: "))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let (short, long) = (run(2_000)?, run(4_000)?);
    Some((long - short) / 2_000.0)
}

fn main() {
    let setup = Setup::new(16 << 30);
    let without = timed(&setup, false);
    let with = timed(&setup, true);
    let valgrind = Command::new("valgrind").arg("--version").output().is_ok();
    println!(
        "{:<22} {:>10} {:>10} {:>8} {:>12} {:>12} {:>8}  {:<28} result",
        "call", "ns", "ns+shim", "ratio", "instr", "instr+shim", "ratio", "target"
    );
    let mut failed = false;
    for (op, label) in [
        ("launch", "cuLaunchKernel"),
        ("alloc", "cuMemAlloc+cuMemFree"),
        ("info", "cuMemGetInfo"),
    ] {
        let (a, b) = (without[&format!("{op}_ns")], with[&format!("{op}_ns")]);
        let (ia, ib) = if valgrind {
            (
                instructions(&setup, false, op),
                instructions(&setup, true, op),
            )
        } else {
            (None, None)
        };
        let instr_ratio = ia.zip(ib).map(|(x, y)| y / x);
        let (target, ok) = match op {
            // Instructions are the steady measure; time on a shared machine is noisy.
            "launch" => (
                "≤ 1.10× (instructions)",
                instr_ratio.map_or(b / a <= 1.10, |r| r <= 1.10),
            ),
            "alloc" => ("accounting < 100 ns", b - a < 100.0),
            _ => ("(reported)", true),
        };
        failed |= !ok;
        let show = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.0}"));
        println!(
            "{label:<22} {a:>10.1} {b:>10.1} {:>7.2}× {:>12} {:>12} {:>8}  {target:<28} {}",
            b / a,
            show(ia),
            show(ib),
            instr_ratio.map_or_else(|| "-".to_string(), |r| format!("{r:.2}×")),
            if ok { "PASS" } else { "FAIL" }
        );
    }
    if !valgrind {
        println!("(valgrind not found: instruction counts skipped)");
    }
    if failed {
        std::process::exit(1);
    }
}
