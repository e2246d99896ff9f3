//! The scenarios: which slices share the GPU, with what shares, and how their processes use it.

use gpuslice_node::workloads::arbiter::Share;

/// How a slice's processes use the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// Launch and wait, back to back.
    Busy,
    /// Every `busy + idle` ms, `busy` ms of kernels, then nothing.
    Bursty { busy_ms: u64, idle_ms: u64 },
    /// Like busy, ten kernels per CUDA graph launch.
    Graph,
    /// Like busy, with cooperative launches.
    Cooperative,
    /// Like busy, with `cuLaunchKernelEx`.
    LaunchEx,
}

#[derive(Clone, Debug)]
pub struct SliceSpec {
    pub name: &'static str,
    pub share: Share,
    pub processes: usize,
    pub work: Work,
    /// The share it should get (%).
    pub target: f64,
}

#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: &'static str,
    pub time_slice_ms: u64,
    pub slices: Vec<SliceSpec>,
}

fn busy(name: &'static str, share: Share, target: f64) -> SliceSpec {
    SliceSpec {
        name,
        share,
        processes: 1,
        work: Work::Busy,
        target,
    }
}

pub(super) fn best_effort(weight: u32) -> Share {
    Share {
        weight,
        limit: 100,
        guarantee: 0,
    }
}

/// The scenarios the issue asks for.
pub fn scenarios() -> Vec<Scenario> {
    let capped = |name, percent: u32| busy(name, Share::capped(percent), f64::from(percent));
    let mixed = [5, 5, 10, 10, 10, 15, 20, 25];
    const MIXED: [&str; 8] = ["m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8"];
    vec![
        Scenario {
            name: "10/90",
            time_slice_ms: 10,
            slices: vec![capped("a", 10), capped("b", 90)],
        },
        Scenario {
            name: "30/70",
            time_slice_ms: 10,
            slices: vec![capped("a", 30), capped("b", 70)],
        },
        Scenario {
            name: "4 x 25",
            time_slice_ms: 10,
            slices: ["a", "b", "c", "d"]
                .into_iter()
                .map(|n| capped(n, 25))
                .collect(),
        },
        Scenario {
            name: "guaranteed 50 + 2 best-effort",
            time_slice_ms: 10,
            slices: vec![
                busy(
                    "g",
                    Share {
                        weight: 34,
                        limit: 100,
                        guarantee: 50,
                    },
                    50.0,
                ),
                busy("x", best_effort(33), 25.0),
                busy("y", best_effort(33), 25.0),
            ],
        },
        Scenario {
            name: "capped 25 alone",
            time_slice_ms: 10,
            slices: vec![capped("a", 25)],
        },
        Scenario {
            name: "8 mixed caps",
            time_slice_ms: 10,
            slices: MIXED
                .into_iter()
                .zip(mixed)
                .map(|(n, p)| capped(n, p))
                .collect(),
        },
        Scenario {
            name: "bursty 30/70 + busy",
            time_slice_ms: 10,
            slices: vec![
                SliceSpec {
                    work: Work::Bursty {
                        busy_ms: 30,
                        idle_ms: 70,
                    },
                    ..busy("burst", best_effort(50), 30.0)
                },
                busy("fill", best_effort(50), 70.0),
            ],
        },
        Scenario {
            name: "2 processes, one slice",
            time_slice_ms: 10,
            slices: vec![
                SliceSpec {
                    processes: 2,
                    ..capped("a", 40)
                },
                capped("b", 60),
            ],
        },
        Scenario {
            name: "graphs 30 / kernels 70",
            time_slice_ms: 10,
            slices: vec![
                SliceSpec {
                    work: Work::Graph,
                    ..capped("g", 30)
                },
                capped("k", 70),
            ],
        },
        Scenario {
            name: "timeSlice 10ms, 50/50",
            time_slice_ms: 10,
            slices: vec![capped("a", 50), capped("b", 50)],
        },
        Scenario {
            name: "timeSlice 50ms, 50/50",
            time_slice_ms: 50,
            slices: vec![capped("a", 50), capped("b", 50)],
        },
    ]
}

/// The id of a scenario's slice.
pub fn slice_id(scenario: usize, name: &str) -> String {
    format!("c{scenario}-{name}")
}
