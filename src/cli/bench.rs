//! `gpuslice bench` (developer build): the benchmarks, each printing a table with a PASS/FAIL
//! column and exiting non-zero on FAIL.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Subcommand)]
pub enum Bench {
    /// Replay the Alibaba GPU-sharing traces under each placement policy (FGD paper method).
    Placement {
        /// The folder of cluster-trace-gpu-v2023 CSVs.
        #[arg(long)]
        data: PathBuf,
        /// Seeds (shuffles) per trace; the paper uses 10.
        #[arg(long, default_value_t = 10)]
        seeds: u64,
        /// Only these trace files (e.g. openb_pod_list_default.csv); every one in the folder by default.
        #[arg(long = "trace")]
        traces: Vec<String>,
        /// Replay constrained variants of the default trace instead: pods that name the GPU
        /// models they may run on (like the FGD paper's gpuspec traces), for every model mix and
        /// share of constrained pods.
        #[arg(long)]
        constrained: bool,
        /// The seed the constrained variants are generated with.
        #[arg(long, default_value_t = 1)]
        variant_seed: u64,
        /// Replay the admission queue's own path instead: each trace's GPU pods in creation
        /// order through the queue's code on the trace's nodes cut into whole GPUs and slices
        /// (by default the default and gpushare* traces: the cpu* ones differ only in GPU-less
        /// pods, which the queue never sees).
        #[arg(long, conflicts_with = "constrained")]
        queue: bool,
    },
    /// Compute shares: real processes under the shim on the emulated GPU (or a real one), target
    /// vs achieved share per slice in every 1 s window, the arbitration's launch overhead,
    /// four jobs sharing the GPU against the same four one after another, and an inference
    /// client's p99 latency beside a training neighbour, time-sliced against MPS.
    Compute {
        /// Seconds per scenario (the first is warm-up).
        #[arg(long, default_value_t = 4)]
        seconds: u64,
        /// Only scenarios whose names contain this (repeatable).
        #[arg(long = "scenario")]
        scenarios: Vec<String>,
        /// Skip the launch-overhead measurement, the four-jobs comparison and the inference
        /// latency comparison (time-sliced against MPS).
        #[arg(long)]
        no_overhead: bool,
        /// Run on this machine's GPU 0 through the real CUDA driver instead of the emulator
        /// (nothing on the GPU is reconfigured; see tests/device/compute.sh).
        #[arg(long)]
        real_gpu: bool,
        /// Only the inference latency comparison, time-sliced against MPS (with --real-gpu, the
        /// driver's nvidia-cuda-mps-control runs a daemon of the bench's own; tests/device/mps.sh).
        #[arg(long, conflicts_with_all = ["no_overhead", "scenarios"])]
        latency_only: bool,
    },
    /// Compaction on the Alibaba default trace: place pods to a load, plan the moves that free
    /// whole GPUs (threshold 30 %), and show GPUs freed against workloads moved.
    Compaction {
        /// The folder of cluster-trace-gpu-v2023 CSVs.
        #[arg(long)]
        data: PathBuf,
        /// Stop placing when pods have asked for this % of the cluster's GPUs.
        #[arg(long, default_value_t = 70.0)]
        load: f64,
        /// Share of GPU-sharing pods that may move (0–1).
        #[arg(long, default_value_t = 0.5)]
        movable: f64,
        /// Share of placed pods that end before compaction runs (0–1).
        #[arg(long, default_value_t = 0.4)]
        depart: f64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Elastic layouts: two weeks of arrivals (the Alibaba trace's sizes and run times, a
    /// diurnal notebook/inference/training mix) on an A100/H100/H200 pool under the best static
    /// layout, day/night windows, and the elastic decision without and with its forecast.
    Elastic {
        /// The folder of cluster-trace-gpu-v2023 CSVs.
        #[arg(long)]
        data: PathBuf,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// GPUs of each of the three models.
        #[arg(long, default_value_t = 16)]
        gpus_per_model: u32,
        /// Scales the arrival rates (1.0: each class's busiest hours ask for its peak share; the
        /// three peaks add up to 1.6 pools, at different hours).
        #[arg(long, default_value_t = 0.75)]
        load: f64,
        /// How much the mix swings over the day: 0 flat (nothing to adapt to), 1 in full.
        #[arg(long, default_value_t = 1.0)]
        swing: f64,
    },
    /// The dataset cache: two epochs over shards from an HTTP source held to a rate; the second,
    /// from the cache, against the local disk's direct-I/O read speed.
    Cache {
        #[arg(long, default_value_t = 8)]
        shards: usize,
        #[arg(long, default_value_t = 16)]
        shard_mib: usize,
        /// What the source serves, MiB/s.
        #[arg(long, default_value_t = 32)]
        source_mib: u64,
    },
    /// A process the compute benchmark runs under the shim.
    #[command(hide = true)]
    ComputeWorker(gpuslice_bench::compute::worker::Plan),
}

/// Prints a benchmark's table; the exit status says whether every row passed.
fn print_table(table: &str, ok: bool) -> ExitCode {
    print!("{table}");
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

pub fn run(which: Bench) -> anyhow::Result<ExitCode> {
    match which {
        Bench::Placement {
            data,
            seeds,
            traces,
            constrained,
            variant_seed,
            queue,
        } => {
            if queue {
                queue_path(&data, &traces)
            } else {
                placement(&data, seeds, &traces, constrained, variant_seed)
            }
        }
        Bench::Compute {
            seconds,
            scenarios,
            no_overhead,
            real_gpu,
            latency_only,
        } => {
            let parts = if latency_only {
                gpuslice_bench::compute::Parts::LatencyOnly
            } else if no_overhead {
                gpuslice_bench::compute::Parts::Shares
            } else {
                gpuslice_bench::compute::Parts::All
            };
            let (table, ok) =
                gpuslice_bench::compute::run_all(seconds.max(2), &scenarios, parts, real_gpu)?;
            Ok(print_table(&table, ok))
        }
        Bench::Compaction {
            data,
            load,
            movable,
            depart,
            seed,
        } => {
            let trace = data.join("openb_pod_list_default.csv");
            let (report, ok) = gpuslice_bench::compaction::run(
                &data,
                &trace,
                gpuslice_bench::compaction::Plan {
                    load,
                    movable: movable.clamp(0.0, 1.0),
                    depart: depart.clamp(0.0, 1.0),
                    seed,
                },
            )?;
            Ok(print_table(&report, ok))
        }
        Bench::Elastic {
            data,
            seed,
            gpus_per_model,
            load,
            swing,
        } => {
            let (table, ok) = gpuslice_bench::elastic::run(
                &data,
                gpuslice_bench::elastic::Plan {
                    seed,
                    gpus_per_model,
                    load,
                    swing,
                },
            )?;
            Ok(print_table(&table, ok))
        }
        Bench::Cache {
            shards,
            shard_mib,
            source_mib,
        } => {
            let (table, ok) = gpuslice_bench::cache::run(gpuslice_bench::cache::Plan {
                shards,
                shard_bytes: shard_mib << 20,
                source_rate: source_mib << 20,
            })?;
            Ok(print_table(&table, ok))
        }
        Bench::ComputeWorker(plan) => {
            let report = gpuslice_bench::compute::worker::run(plan).map_err(anyhow::Error::msg)?;
            println!("{report}");
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `bench placement --queue`: the queue's path on every trace in `data` (or the `traces` named).
fn queue_path(data: &Path, traces: &[String]) -> anyhow::Result<ExitCode> {
    use gpuslice_bench::{placement, queue_path};
    let nodes = placement::cluster(data)?;
    // The cpu* traces add GPU-less pods to the default one, which the queue never sees.
    let files: Vec<PathBuf> = if traces.is_empty() {
        placement::traces(data)?
            .into_iter()
            .filter(|f| !placement::trace_name(f).starts_with("cpu"))
            .collect()
    } else {
        traces.iter().map(|t| data.join(t)).collect()
    };
    let mut results = Vec::new();
    for file in &files {
        let arrivals = queue_path::arrivals(file)?;
        let name = placement::trace_name(file);
        results.push((name, queue_path::run(&nodes, &arrivals)));
        eprintln!("replayed {}", file.display());
    }
    let (table, ok) = queue_path::render(&results);
    Ok(print_table(&table, ok))
}

/// `bench placement`: every trace in `data` (or the `traces` named), or the constrained
/// variants of the default trace, under each placement policy.
fn placement(
    data: &Path,
    seeds: u64,
    traces: &[String],
    constrained: bool,
    variant_seed: u64,
) -> anyhow::Result<ExitCode> {
    use gpuslice_bench::placement as bench;
    let nodes = bench::cluster(data)?;
    if constrained {
        let pods = bench::pods(&data.join("openb_pod_list_default.csv"))?;
        let mut results = Vec::new();
        for mix in bench::model_mixes(&nodes) {
            for share in bench::CONSTRAINED_SHARES {
                let variant = bench::constrained(&pods, &nodes, share, &mix, variant_seed);
                let name = format!("{}-{:.0}%", mix.name, share * 100.0);
                results.push(bench::run_pods(&nodes, &name, &variant, seeds));
                eprintln!("replayed {name}");
            }
        }
        let (table, ok) = bench::render(&results, seeds);
        return Ok(print_table(&table, ok));
    }
    let files = if traces.is_empty() {
        bench::traces(data)?
    } else {
        traces.iter().map(|t| data.join(t)).collect()
    };
    let mut results = Vec::new();
    for file in &files {
        results.push(bench::run_trace(&nodes, file, seeds)?);
        eprintln!("replayed {}", file.display());
    }
    let (table, ok) = bench::render(&results, seeds);
    Ok(print_table(&table, ok))
}
