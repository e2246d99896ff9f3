//! The table the bench prints, with its PASS/FAIL verdicts.

use super::latency::{PERIOD_MS, REQUEST_MS, TRAINING_KERNEL_MS};
use super::{JOBS, Jobs, LATENCY_TARGET, Latency, Overhead, ScenarioResult, TOLERANCE};

/// The table: per slice, target and achieved share per window and overall; per scenario,
/// switches and throughput; then the overhead line. Returns it and whether all passed.
pub fn render(
    gpu: &str,
    results: &[ScenarioResult],
    overhead: Option<Overhead>,
    jobs: Option<Jobs>,
    latency: Option<Latency>,
) -> (String, bool) {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mut ok = true;
    let _ = writeln!(
        out,
        "compute shares on {gpu}; share % per 1 s window, the first is warm-up; ±{TOLERANCE} pp, or one time slice where that is more"
    );
    let _ = writeln!(
        out,
        "{:<32} {:>5} {:<6} {:>6} {:>8}  {:<28} {:>13} {:>10} {:>9}  result",
        "scenario",
        "slice",
        "",
        "target",
        "overall",
        "windows",
        "wait ms p99/max",
        "switches/s",
        "kernels/s"
    );
    for r in results {
        let passed = r.passed();
        ok &= passed;
        for (i, s) in r.slices.iter().enumerate() {
            let windows: Vec<String> = s.windows.iter().map(|w| format!("{w:.1}")).collect();
            let first = i == 0;
            let _ = writeln!(
                out,
                "{:<32} {:>5} {:<6} {:>6.1} {:>8.2}  {:<28} {:>13} {:>10} {:>9}  {}",
                if first { r.name.as_str() } else { "" },
                s.name,
                if s.guaranteed { "(g)" } else { "" },
                s.target,
                s.overall,
                windows.join(" "),
                format!(
                    "{}/{:.1}",
                    s.p99_wait_ms
                        .map_or_else(|| "-".to_string(), |p| format!("{p:.0}")),
                    s.max_wait_ms
                ),
                if first {
                    format!("{:.0}", r.switches_per_s)
                } else {
                    String::new()
                },
                if first {
                    format!("{:.0}", r.kernels_per_s)
                } else {
                    String::new()
                },
                if s.holds() && (!s.guaranteed || passed) {
                    "PASS"
                } else {
                    "FAIL"
                }
            );
        }
    }
    if let Some(o) = overhead {
        let (verdict, passed) = o.verdict();
        ok &= passed;
        let _ = writeln!(
            out,
            "\nlaunch cost, one process, no cap, shim with arbitration against without: {verdict}  {}",
            if passed { "PASS" } else { "FAIL" }
        );
    }
    if let Some(j) = jobs {
        let _ = writeln!(
            out,
            "{JOBS} jobs of {} kernels: one after another {:.2} s, sharing the GPU (equal weights) {:.2} s; aggregate throughput sharing / one after another {:.3}",
            j.kernels,
            j.one_after_another,
            j.together,
            j.one_after_another / j.together.max(1e-9)
        );
    }
    if let Some(l) = latency {
        let (ratio, passed) = l.verdict();
        ok &= passed;
        let _ = writeln!(
            out,
            "\ninference latency beside a training neighbour ({REQUEST_MS} ms request every {PERIOD_MS} ms; neighbour: {TRAINING_KERNEL_MS} ms kernels back to back)"
        );
        let _ = writeln!(
            out,
            "{:<44} {:>8} {:>8} {:>8}",
            "sharing", "requests", "p50 ms", "p99 ms"
        );
        for (name, p) in [
            ("time-sliced (arbiter, equal weights)", l.time_sliced),
            ("MPS (50 % of the SMs each)", l.mps),
        ] {
            let _ = writeln!(
                out,
                "{name:<44} {:>8} {:>8.2} {:>8.2}",
                p.requests, p.p50, p.p99
            );
        }
        let _ = writeln!(
            out,
            "p99 MPS / time-sliced {ratio:.3} (target ≤ {LATENCY_TARGET})  {}",
            if passed { "PASS" } else { "FAIL" }
        );
    }
    (out, ok)
}
