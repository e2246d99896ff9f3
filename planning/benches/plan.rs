//! Planning benchmark: 5,000 nodes × 8 GPUs (half H200 in MIG, half A100 80GB with software
//! slices, a mix of current states and busy instances), planned just before and just after a
//! window boundary that changes every GPU's layout. Prints a table; exits non-zero on FAIL.
//!
//!     cargo bench -p gpuslice-planning --bench plan

use std::time::{Duration, Instant};

use chrono::{DateTime, TimeZone, Utc};
use gpuslice_api::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use gpuslice_api::k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use gpuslice_api::{
    ClockTime, GpuInventory, GpuPool, GpuPoolSpec, GpuProcess, Layout, MigInstance, MigLayout,
    MigPreset, MigState, NodeInventory, Placement, SoftwareSliceState, TimeWindow, Weekday,
};
use gpuslice_planning::cluster::plan_cluster;

const NODES: usize = 5_000;
const GPUS_PER_NODE: u32 = 8;
const TARGET: Duration = Duration::from_millis(200);

fn pool(name: &str, layout: Layout, night: Layout) -> GpuPool {
    GpuPool {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: GpuPoolSpec {
            node_selector: LabelSelector {
                match_labels: Some([("pool".to_string(), name.to_string())].into()),
                ..Default::default()
            },
            gpu_selector: None,
            layout,
            elastic: None,
            windows: vec![TimeWindow {
                name: "night".into(),
                time_zone: "Asia/Shanghai".into(),
                days: Weekday::ALL.to_vec(),
                start: ClockTime::from("20:00"),
                end: ClockTime::from("08:00"),
                layout: night,
                elastic: None,
                priorities: Default::default(),
            }],
            time_slice: None,
            memory_headroom: None,
            scheduling: None,
            checkpoint_policy: None,
            compaction: None,
            io: None,
            fault_isolation: None,
            require_non_root: false,
            driver: None,
        },
        status: None,
    }
}

fn preset(p: MigPreset) -> Layout {
    Layout {
        mig: Some(MigLayout {
            profiles: Default::default(),
            preset: Some(p),
            mps: None,
        }),
        ..Layout::default()
    }
}

/// A deterministic pseudo-random sequence (no dependency needed for a benchmark's data).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn h200_gpu(index: u32, rng: &mut Lcg) -> GpuInventory {
    let busy = |rng: &mut Lcg| {
        if rng.next().is_multiple_of(5) {
            vec![GpuProcess {
                pid: 1000 + index,
                memory: None,
                name: None,
            }]
        } else {
            vec![]
        }
    };
    let inst = |profile: &str, start, size, rng: &mut Lcg| MigInstance {
        profile: profile.into(),
        placement: Placement { start, size },
        uuid: None,
        processes: busy(rng),
        slices: Vec::new(),
    };
    let instances = match rng.next() % 3 {
        // The day layout (balanced) in place.
        0 => vec![
            inst("2g.35gb", 0, 2, rng),
            inst("1g.18gb", 2, 1, rng),
            inst("1g.18gb", 3, 1, rng),
            inst("3g.71gb", 4, 4, rng),
        ],
        // All 1g.
        1 => (0..7).map(|s| inst("1g.18gb", s, 1, rng)).collect(),
        // Two 3g.
        _ => vec![inst("3g.71gb", 0, 4, rng), inst("3g.71gb", 4, 4, rng)],
    };
    GpuInventory {
        index,
        model: "NVIDIA H200".into(),
        mig: Some(MigState {
            enabled: true,
            instances,
        }),
        ..Default::default()
    }
}

fn a100_gpu(index: u32, rng: &mut Lcg) -> GpuInventory {
    let slices = (0..4)
        .map(|s| SoftwareSliceState {
            id: format!("s{index}-{s}"),
            memory: Quantity("20Gi".into()),
            compute: 25,
            mps: false,
            processes: if rng.next().is_multiple_of(4) {
                vec![GpuProcess {
                    pid: 1,
                    memory: None,
                    name: None,
                }]
            } else {
                vec![]
            },
        })
        .collect();
    GpuInventory {
        index,
        model: "NVIDIA A100-SXM4-80GB".into(),
        slices,
        ..Default::default()
    }
}

fn cluster() -> Vec<NodeInventory> {
    let mut rng = Lcg(42);
    (0..NODES)
        .map(|n| {
            let h200 = n % 2 == 0;
            let pool = if h200 { "mig-h200" } else { "soft-a100" };
            NodeInventory {
                name: format!("node-{n:05}"),
                labels: [("pool".to_string(), pool.to_string())].into(),
                gpus: (0..GPUS_PER_NODE)
                    .map(|i| {
                        if h200 {
                            h200_gpu(i, &mut rng)
                        } else {
                            a100_gpu(i, &mut rng)
                        }
                    })
                    .collect(),
                ..Default::default()
            }
        })
        .collect()
}

fn measure(
    pools: &[GpuPool],
    nodes: &[NodeInventory],
    at: DateTime<Utc>,
) -> (Duration, Duration, usize) {
    let mut times = Vec::new();
    let mut ops = 0;
    for _ in 0..7 {
        let start = Instant::now();
        let plan = plan_cluster(pools, nodes, at);
        times.push(start.elapsed());
        ops = plan
            .nodes
            .iter()
            .flat_map(|n| &n.gpus)
            .map(|g| g.ops.len())
            .sum();
        std::hint::black_box(plan);
    }
    times.sort();
    (times[0], times[times.len() / 2], ops)
}

fn main() {
    let pools = vec![
        pool(
            "mig-h200",
            preset(MigPreset::Balanced),
            preset(MigPreset::Whole),
        ),
        pool(
            "soft-a100",
            Layout::software(4, "20Gi", 25),
            Layout::software(2, "40Gi", 50),
        ),
    ];
    let nodes = cluster();
    // 20:00 in Shanghai is 12:00 UTC.
    let before = Utc.with_ymd_and_hms(2026, 12, 2, 11, 59, 0).unwrap();
    let after = Utc.with_ymd_and_hms(2026, 12, 2, 12, 0, 0).unwrap();
    println!("| case | nodes × GPUs | operations planned | best | median | target | result |");
    println!("|---|---|---|---|---|---|---|");
    let mut failed = false;
    for (case, at) in [
        ("day layout, before the boundary", before),
        ("window change (night opens)", after),
    ] {
        let (best, median, ops) = measure(&pools, &nodes, at);
        let pass = median < TARGET;
        failed |= !pass;
        println!(
            "| {case} | {NODES} × {GPUS_PER_NODE} | {ops} | {:.1} ms | {:.1} ms | < {} ms | {} |",
            best.as_secs_f64() * 1e3,
            median.as_secs_f64() * 1e3,
            TARGET.as_millis(),
            if pass { "PASS" } else { "FAIL" }
        );
    }
    if failed {
        std::process::exit(1);
    }
}
