use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use gpuslice_api::Kind;
use gpuslice_contract::StateDir;
use gpuslice_runtime::logging::{self, LogFormat};
use gpuslice_source::SourceSpec;
use gpuslice_source::validate::{read_repository, validate_files};

/// Fine-grained GPU sharing on Kubernetes: MIG layouts and software slices declared in Git.
#[derive(Parser)]
#[command(name = "gpuslice", version, about)]
struct Cli {
    /// How the agent and the operator log (to stderr; RUST_LOG filters, default info).
    #[arg(long, global = true, value_enum, default_value_t = LogOutput::Text)]
    log_format: LogOutput,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogOutput {
    Text,
    Json,
}

// Parsed once at start; boxing the agent's options would only move them.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Check a GitOps folder or repository: every error as file:line: Kind/name: field: reason.
    Validate {
        /// A folder, a YAML file, a local Git repository or a Git URL.
        source: String,
        /// Git branch, tag or commit to read (a local folder is read from disk when omitted).
        #[arg(long = "ref")]
        git_ref: Option<String>,
        /// Sub-folder of the source to read.
        #[arg(long)]
        path: Option<String>,
        /// Output format.
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Plan every GPU of an inventory against the pools of a source: layout now, operations, next
    /// change. With --against, what a change does: the GPUs it re-cuts, the busy slices that would
    /// block it and whose workloads they are, the windows it changes (exit 2 when it would wait
    /// for running work, 1 when it cannot be planned).
    Plan {
        /// A folder, a YAML file, a local Git repository or a Git URL (as for validate).
        source: String,
        /// A node (NodeInventory: name, labels, GPUs with model and current state), a YAML list
        /// of them, or the cluster's GpuNodes (`kubectl get gpunodes -o yaml`).
        #[arg(long)]
        nodes: PathBuf,
        /// The instant to plan for (RFC 3339, e.g. 2026-12-02T21:00:00+08:00); now by default.
        #[arg(long)]
        at: Option<chrono::DateTime<chrono::FixedOffset>>,
        /// The revision to plan (the folder as it is on disk when omitted).
        #[arg(long = "ref")]
        git_ref: Option<String>,
        /// Compare with this Git revision of the same repository (the pull request's base,
        /// e.g. origin/main): only what differs is shown.
        #[arg(long)]
        against: Option<String>,
        #[arg(long)]
        path: Option<String>,
        /// Output format; markdown (with --against) is for a pull-request comment.
        #[arg(long, short, value_enum, default_value_t = PlanOutput::Text)]
        output: PlanOutput,
        /// Show what compaction would move in each pool with `spec.compaction` (from the
        /// GpuNodes' claims: who holds which software slice), instead of the layouts.
        #[arg(long, conflicts_with = "against")]
        compaction: bool,
    },
    /// The node agent. Standalone: converge this node's GPUs to the pools of a folder or Git
    /// repository, every interval and at each window boundary (or once, with --once).
    Agent {
        /// A folder, a YAML file, a local Git repository or a Git URL holding the pools. Git
        /// sources are fetched on every pass; a bad commit leaves the last good config in force.
        #[arg(long, required_unless_present = "kube", conflicts_with = "kube")]
        source: Option<String>,
        /// In a cluster: apply this node's GpuNode (written by the operator) and report its
        /// status, instead of reading pools from a source. Uses the in-cluster config or
        /// KUBECONFIG; the node name comes from --node-name, NODE_NAME or the host name.
        #[arg(long)]
        kube: bool,
        /// With --kube: serve /metrics and /healthz here (e.g. 0.0.0.0:8081).
        #[arg(long, requires = "kube")]
        metrics_addr: Option<std::net::SocketAddr>,
        /// Git branch, tag or commit to follow (the remote's default branch when omitted).
        #[arg(long = "ref")]
        git_ref: Option<String>,
        /// Sub-folder of the source to read.
        #[arg(long)]
        path: Option<String>,
        /// This node's name and labels, as a NodeInventory YAML (name, labels); with --emulate the
        /// emulated node's file gives them.
        #[arg(long)]
        node_file: Option<PathBuf>,
        /// This node's name (default: from --node-file or --emulate, else the host name).
        #[arg(long)]
        node_name: Option<String>,
        /// A node label pools select on, key=value; repeat for more. Added to the node file's.
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// Run against an emulated node described by this NodeInventory YAML instead of real GPUs.
        #[arg(long, conflicts_with = "nvml")]
        emulate: Option<PathBuf>,
        /// With --emulate: where the emulated machine keeps its state (the emulated driver, which
        /// containers share through a host path) instead of the state directory's
        /// `emulated-<node>.json`.
        #[arg(long, requires = "emulate")]
        emulator_state: Option<PathBuf>,
        /// Load NVML from this library instead of the system's libnvidia-ml.so.1.
        #[arg(long)]
        nvml: Option<PathBuf>,
        /// The agent's state directory (slice tables and configs, the last good source, drain
        /// records; the emulated machine with --emulate).
        #[arg(long, default_value = gpuslice_contract::paths::DEFAULT)]
        state: PathBuf,
        /// Change the GPUs; without it the agent only reports what it would do.
        #[arg(long)]
        apply: bool,
        /// Where the pools' dataset caches (`io.localCache.path`, a folder under
        /// /var/lib/gpuslice/cache) are kept: this folder stands for /var/lib/gpuslice/cache.
        #[arg(long, default_value = gpuslice_api::CACHE_ROOT)]
        cache_root: PathBuf,
        /// Run one pass and exit.
        #[arg(long)]
        once: bool,
        /// How often to fetch the source and reconcile (Go duration).
        #[arg(long, default_value = "30s")]
        interval: gpuslice_api::Duration,
        /// With --kube: taint a GPU's DRA devices (gpuslice.io/recut, NoSchedule) this long before
        /// a window change re-cuts it, so that no new pod lands on a slice about to go.
        #[arg(long, default_value = "10m", requires = "kube")]
        recut_lookahead: gpuslice_api::Duration,
        /// With --kube: serve the DRA kubelet plugin (driver gpuslice.io) for the kubelet whose
        /// root directory this is (registration in <dir>/plugins_registry), e.g. /var/lib/kubelet.
        #[arg(long, requires = "kube")]
        kubelet_dir: Option<PathBuf>,
        /// Where the container runtime reads CDI specs; the plugin writes one per prepared claim.
        #[arg(long, default_value = "/var/run/cdi", requires = "kubelet_dir")]
        cdi_dir: PathBuf,
        /// The kernel log whose NVRM XID records name the process that caused an XID (NVML's
        /// events do not), so that fault isolation quarantines its slice.
        #[arg(long, default_value = "/dev/kmsg")]
        kernel_log: PathBuf,
        /// How often the memory watchdog reads each process's GPU memory from NVML: a software
        /// slice holding more than its cap (a workload that bypassed the shim) has its biggest
        /// process sent SIGTERM.
        #[arg(long, default_value = "1s")]
        memory_watchdog_interval: gpuslice_api::Duration,
        /// From the watchdog's SIGTERM to SIGKILL while the slice stays over its cap; 0s kills
        /// at once.
        #[arg(long, default_value = "5s")]
        memory_watchdog_grace: gpuslice_api::Duration,
        /// The instant to plan for (RFC 3339), with --once; now by default.
        #[arg(long, requires = "once")]
        at: Option<chrono::DateTime<chrono::FixedOffset>>,
        #[arg(long, short, value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Run a command on a slice of this node: ask the agent for one that fits (waiting in line
    /// when none is free), run the command under the shim with the slice's limits, give the slice
    /// back when it ends.
    Run {
        /// The agent's state directory.
        #[arg(long, default_value = gpuslice_contract::paths::DEFAULT)]
        state: PathBuf,
        /// A GpuSlicePolicy of the agent's source: its memory (plus the pool's headroom) and
        /// compute limit.
        #[arg(long)]
        policy: Option<String>,
        /// GPU memory the command needs, e.g. 20Gi.
        #[arg(long)]
        memory: Option<String>,
        /// Compute share the command needs, in percent of a GPU.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100))]
        compute: Option<u32>,
        /// Fail at once when no slice is free instead of waiting in line.
        #[arg(long)]
        no_wait: bool,
        /// The shim to preload (default: libgpuslice.so next to gpuslice).
        #[arg(long)]
        shim: Option<PathBuf>,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// A dataset file through this node's local cache (a pool's io.localCache): prints the local,
    /// read-only path with the source's bytes, fetched once for all who ask.
    Cache {
        /// An absolute path (a mounted dataset) or an http:// URL.
        source: String,
        /// The pool whose cache, when the node has several.
        #[arg(long)]
        pool: Option<String>,
        /// The agent's state directory.
        #[arg(long, default_value = gpuslice_contract::paths::DEFAULT)]
        state: PathBuf,
    },
    /// Tell this node's agent that GPUs were reset (after `nvidia-smi -r`), so that it lifts
    /// their XID quarantines: `1`, `0,3` or `all`. Root only. In a cluster, annotating the
    /// GpuNode `gpuslice.io/gpu-reset=<gpus>` does the same.
    GpuReset {
        gpus: String,
        /// The agent's state directory.
        #[arg(long, default_value = gpuslice_contract::paths::DEFAULT)]
        state: PathBuf,
    },
    /// Ask the operator to compact a pool now, outside its compaction window: annotates the
    /// GpuPool gpuslice.io/compact-now; the round shows in its status.compaction. Uses the
    /// in-cluster config or KUBECONFIG.
    Compact {
        /// The GpuPool (its spec.compaction must be enabled).
        pool: String,
    },
    /// The operator: reconcile GpuPools into each node's desired layout (GpuNode) and pool status.
    /// Uses the in-cluster config or KUBECONFIG.
    Operator {
        /// Serve /metrics and /healthz here (e.g. 0.0.0.0:8080).
        #[arg(long)]
        metrics_addr: Option<std::net::SocketAddr>,
        /// The namespace of the leader-election Lease (default: POD_NAMESPACE, else default).
        #[arg(long)]
        lease_namespace: Option<String>,
        /// How long a leader's lease lasts without renewal (Go duration).
        #[arg(long, default_value = "15s")]
        lease_duration: gpuslice_api::Duration,
        /// Keep the admission policy's parameters in this ConfigMap (NAMESPACE/NAME): each
        /// GpuSlicePolicy and the namespaces its namespaceSelector lets use it. The chart sets it.
        #[arg(long, value_parser = parse_object_ref)]
        admission_params: Option<gpuslice_operator::controller::AdmissionParams>,
        /// How long a node's agent may leave a preemption in its GpuNode unread before the
        /// waiting pod and the pool (a Warning Event) say so; after five times as long the
        /// preemption is given up and the claim left alone for 10 minutes.
        #[arg(long, default_value = "60s")]
        agent_timeout: gpuslice_api::Duration,
    },
    /// Benchmarks that print a table with a PASS/FAIL column and exit non-zero on FAIL.
    Bench {
        #[command(subcommand)]
        which: Bench,
    },
    /// Try the cluster path on this machine: a private Kubernetes control plane with fake nodes
    /// for the example pools, the chart's CRDs, roles and admission policies, the operator and an
    /// emulated agent per node as local processes, examples/gitops applied. Prints the
    /// KUBECONFIG and what to try; Ctrl-C stops everything and deletes its folder. Needs
    /// `bash tests/controlplane/build.sh` and `bash tests/helm/build.sh` once.
    Demo {
        /// The checkout whose crds/, charts/gpuslice and examples/gitops are used.
        #[arg(long, default_value = env!("CARGO_MANIFEST_DIR"))]
        repo: PathBuf,
        /// Start the operator's and agents' clock here (RFC 3339) instead of shortly before the
        /// example pools' next window change.
        #[arg(long)]
        clock: Option<chrono::DateTime<chrono::FixedOffset>>,
        /// How long after the start the example pools' next window change comes (without --clock).
        #[arg(long, default_value = "5m")]
        window_in: gpuslice_api::Duration,
    },
    /// Write the CustomResourceDefinitions, generated from the API types, into a folder.
    Crds {
        /// Where to write them.
        #[arg(long, default_value = "crds")]
        dir: PathBuf,
        /// Do not write: fail if the folder differs from the types.
        #[arg(long)]
        check: bool,
    },
}

#[derive(Subcommand)]
enum Bench {
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
    },
    /// Compute shares: real processes under the shim on the emulated GPU (or a real one), target
    /// vs achieved share per slice in every 1 s window, the arbitration's launch overhead, and
    /// four jobs sharing the GPU against the same four one after another.
    Compute {
        /// Seconds per scenario (the first is warm-up).
        #[arg(long, default_value_t = 4)]
        seconds: u64,
        /// Only scenarios whose names contain this (repeatable).
        #[arg(long = "scenario")]
        scenarios: Vec<String>,
        /// Skip the launch-overhead measurement and the four-jobs comparison.
        #[arg(long)]
        no_overhead: bool,
        /// Run on this machine's GPU 0 through the real CUDA driver instead of the emulator
        /// (nothing on the GPU is reconfigured; see tests/device/compute.sh).
        #[arg(long)]
        real_gpu: bool,
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
    ComputeWorker {
        #[arg(long)]
        kernel_us: u64,
        #[arg(long, default_value_t = 1.0)]
        seconds: f64,
        #[arg(long)]
        busy_ms: Option<u64>,
        #[arg(long, default_value_t = 0)]
        idle_ms: u64,
        /// Launch CUDA graphs of this many kernels.
        #[arg(long)]
        graph: Option<u32>,
        #[arg(long)]
        cooperative: bool,
        /// Launch with cuLaunchKernelEx.
        #[arg(long)]
        ex: bool,
        /// Launch this many kernels as fast as possible and report the rate.
        #[arg(long)]
        launches: Option<u64>,
        /// Stop after this many kernels (a job of fixed work) instead of after --seconds.
        #[arg(long)]
        kernels: Option<u64>,
        /// Real GPU: the busy loop's iterations per kernel.
        #[arg(long)]
        iterations: Option<u64>,
        /// Real GPU: find the iterations for --kernel-us and report them.
        #[arg(long)]
        calibrate: bool,
        /// Start working at this CLOCK_MONOTONIC time (ns), once set up.
        #[arg(long)]
        start_at: Option<u64>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Text,
    Json,
}

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum PlanOutput {
    Text,
    Json,
    Markdown,
}

/// The pools of one revision of a source, or `None` (after printing why) when it does not
/// validate: a plan of a broken revision would mislead.
/// Prints a benchmark's table; the exit status says whether every row passed.
fn print_table(table: &str, ok: bool) -> ExitCode {
    print!("{table}");
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn pools_of(
    location: &str,
    git_ref: Option<String>,
    sub_path: Option<String>,
    at: chrono::DateTime<chrono::Utc>,
    revision: &str,
) -> anyhow::Result<Option<Vec<gpuslice_api::GpuPool>>> {
    Ok(config_of(location, git_ref, sub_path, at, revision)?.map(|(pools, _)| pools))
}

/// The pools and policies of a source's revision; `None` (after saying why) when it does not
/// validate.
fn config_of(
    location: &str,
    git_ref: Option<String>,
    sub_path: Option<String>,
    at: chrono::DateTime<chrono::Utc>,
    revision: &str,
) -> anyhow::Result<
    Option<(
        Vec<gpuslice_api::GpuPool>,
        Vec<gpuslice_api::GpuSlicePolicy>,
    )>,
> {
    let spec = SourceSpec {
        location: location.to_string(),
        git_ref,
        sub_path,
    };
    let snapshot = gpuslice_source::load(&spec)
        .with_context(|| format!("reading {revision} of {location}"))?;
    let (report, repo) = read_repository(&snapshot.files, at);
    if !report.ok() {
        for p in &report.problems {
            eprintln!("{p}");
        }
        eprintln!(
            "{revision}: {}; fix the source before planning",
            report.summary()
        );
        return Ok(None);
    }
    Ok(Some((
        repo.pools.into_iter().map(|p| p.object).collect(),
        repo.policies.into_iter().map(|p| p.object).collect(),
    )))
}

/// `NAMESPACE/NAME`.
fn parse_object_ref(text: &str) -> Result<gpuslice_operator::controller::AdmissionParams, String> {
    match text.split_once('/') {
        Some((namespace, name)) if !namespace.is_empty() && !name.is_empty() => {
            Ok(gpuslice_operator::controller::AdmissionParams {
                namespace: namespace.to_string(),
                name: name.to_string(),
            })
        }
        _ => Err(format!("{text:?}: expected NAMESPACE/NAME")),
    }
}

fn parse_label(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("{text:?}: a label is key=value"))
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    // The demo talks to a person; its operator and agents log to its folder.
    if !matches!(cli.command, Command::Demo { .. }) {
        logging::init(match cli.log_format {
            LogOutput::Text => LogFormat::Text,
            LogOutput::Json => LogFormat::Json,
        });
    }
    match cli.command {
        Command::Validate {
            source,
            git_ref,
            path,
            output,
        } => {
            let spec = SourceSpec {
                location: source,
                git_ref,
                sub_path: path,
            };
            let snapshot = gpuslice_source::load(&spec)?;
            let mut report = validate_files(&snapshot.files, chrono::Utc::now());
            report.revision = snapshot.revision;
            match output {
                Output::Text => {
                    for p in &report.problems {
                        println!("{p}");
                    }
                    println!("{}", report.summary());
                }
                Output::Json => println!("{}", serde_json::to_string_pretty(&report)?),
            }
            Ok(if report.ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Plan {
            source,
            nodes,
            at,
            git_ref,
            against,
            path,
            output,
            compaction,
        } => {
            let at = at.map_or_else(chrono::Utc::now, |t| t.with_timezone(&chrono::Utc));
            let text = std::fs::read_to_string(&nodes)
                .with_context(|| format!("reading {}", nodes.display()))?;
            let inventory = gpuslice::plan::parse_inventory(&nodes.display().to_string(), &text)?;
            let head_name = git_ref.clone().unwrap_or_else(|| "the working tree".into());
            let Some((head, policies)) = config_of(&source, git_ref, path.clone(), at, &head_name)?
            else {
                return Ok(ExitCode::FAILURE);
            };
            if compaction {
                let plan = gpuslice_planning::cluster::plan_cluster(&head, &inventory.nodes, at);
                let plans = gpuslice::plan::compaction(&head, &policies, &plan, &inventory);
                match output {
                    PlanOutput::Json => println!("{}", serde_json::to_string_pretty(&plans)?),
                    _ => print!("{}", gpuslice::plan::render_compaction(&plans)),
                }
                return Ok(ExitCode::SUCCESS);
            }
            let Some(base_ref) = against else {
                let plan = gpuslice_planning::cluster::plan_cluster(&head, &inventory.nodes, at);
                match output {
                    PlanOutput::Text => print!("{}", gpuslice::plan::render(&plan)),
                    PlanOutput::Json => println!("{}", serde_json::to_string_pretty(&plan)?),
                    PlanOutput::Markdown => {
                        eprintln!(
                            "--output markdown shows a change: give --against <base revision>"
                        );
                        return Ok(ExitCode::FAILURE);
                    }
                }
                return Ok(if gpuslice::plan::has_errors(&plan) {
                    ExitCode::FAILURE
                } else {
                    ExitCode::SUCCESS
                });
            };
            let Some(base) = pools_of(&source, Some(base_ref.clone()), path, at, &base_ref)? else {
                return Ok(ExitCode::FAILURE);
            };
            let diff = gpuslice_planning::diff::diff(&base, &head, &inventory.nodes, at);
            match output {
                PlanOutput::Text => print!(
                    "{}",
                    gpuslice::plan::render_diff(&diff, &inventory, &base_ref, &head_name)
                ),
                PlanOutput::Json => println!("{}", serde_json::to_string_pretty(&diff)?),
                PlanOutput::Markdown => print!(
                    "{}",
                    gpuslice::plan::render_diff_markdown(&diff, &inventory, &base_ref, &head_name)
                ),
            }
            Ok(if diff.head_errors().next().is_some() {
                ExitCode::FAILURE
            } else if diff.blocks_on_running_work() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            })
        }
        Command::Agent {
            source,
            kube,
            metrics_addr,
            git_ref,
            path,
            node_file,
            node_name,
            labels,
            emulate,
            emulator_state,
            nvml,
            state,
            apply,
            cache_root,
            once,
            interval,
            recut_lookahead,
            kubelet_dir,
            cdi_dir,
            kernel_log,
            memory_watchdog_interval,
            memory_watchdog_grace,
            at,
            output,
        } => {
            let watchdog = gpuslice_node::watchdog::Settings {
                interval: memory_watchdog_interval.into(),
                grace: memory_watchdog_grace.into(),
            };
            let clock = gpuslice_planning::clock::Clock::from_env()?;
            let node_name =
                node_name.or_else(|| std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty()));
            let mut node = match emulate.as_ref().or(node_file.as_ref()) {
                Some(file) => {
                    let text = std::fs::read_to_string(file)
                        .with_context(|| format!("reading {}", file.display()))?;
                    serde_yaml::from_str::<gpuslice_api::NodeInventory>(&text)
                        .with_context(|| format!("{}: not a NodeInventory", file.display()))?
                }
                None => gpuslice_api::NodeInventory::default(),
            };
            if let Some(name) = node_name {
                node.name = name;
            }
            if node.name.is_empty() {
                node.name = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_string())
                    .context("no node name: give --node-name or --node-file")?;
            }
            node.labels.extend(labels);
            let state = StateDir::new(state);
            let library = match &emulate {
                Some(_) => {
                    let machine =
                        emulator_state.unwrap_or_else(|| state.emulated_machine(&node.name));
                    gpuslice_node::emulate::prepare_emulator(&machine, &node)?;
                    Some(gpuslice_node::emulate::emulator_library()?)
                }
                None => nvml,
            };
            if kube {
                let settings = gpuslice_node::cluster::Settings {
                    interval: interval.into(),
                    recut_lookahead: recut_lookahead.into(),
                    kubelet: kubelet_dir.map(|dir| {
                        let shim = gpuslice::run::shim_library()
                            .inspect_err(|e| tracing::warn!("containers get no shim: {e}"))
                            .ok();
                        gpuslice_node::kubelet::Paths::new(&dir, &cdi_dir, shim)
                    }),
                    faults: gpuslice_node::faults::Inbox::default(),
                    cache_root,
                };
                match gpuslice_node::faults::follow_kernel_log(&kernel_log, settings.faults.clone())
                {
                    Ok(_) => tracing::info!("reading XID records from {}", kernel_log.display()),
                    Err(e) => tracing::warn!(
                        "XIDs cannot be traced to processes ({e}): a software slice is quarantined only when it is the only one held on its GPU"
                    ),
                }
                agent_in_cluster(
                    node,
                    library,
                    state,
                    clock,
                    settings,
                    watchdog,
                    metrics_addr,
                )?;
                return Ok(ExitCode::SUCCESS);
            }
            let options = gpuslice_node::standalone::Options {
                source: SourceSpec {
                    location: source.context("--source is required without --kube")?,
                    git_ref,
                    sub_path: path,
                },
                node,
                library,
                state,
                apply,
                once,
                at: at.map(|t| t.with_timezone(&chrono::Utc)),
                interval: interval.into(),
                clock,
                kernel_log,
                watchdog,
                cache_root,
            };
            let mut shown = String::new();
            let last = gpuslice_node::standalone::run(&options, |pass| {
                show_pass(pass, once, output, &mut shown)
            })?;
            Ok(if last.failed() {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            })
        }
        Command::Run {
            state,
            policy,
            memory,
            compute,
            no_wait,
            shim,
            command,
        } => {
            let memory_bytes = memory
                .map(|m| gpuslice_api::bytes_of(&m).with_context(|| format!("--memory {m:?}")))
                .transpose()?;
            let want = gpuslice_contract::socket::Want {
                policy,
                memory_bytes,
                compute_percent: compute,
                no_wait,
            };
            let shim = match shim {
                Some(s) => s,
                None => gpuslice::run::shim_library()?,
            };
            let code = gpuslice::run::run(&StateDir::new(state), &want, &shim, &command)?;
            Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
        }
        Command::Cache {
            source,
            pool,
            state,
        } => {
            let (path, hit) =
                gpuslice::run::cache_fetch(&StateDir::new(state), &source, pool.as_deref())?;
            eprintln!("gpuslice cache: {}", if hit { "cached" } else { "fetched" });
            println!("{}", path.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::GpuReset { gpus, state } => {
            gpuslice::run::gpu_reset(&StateDir::new(state), &gpus)?;
            println!("GPU(s) {gpus}: the agent lifts their quarantines at its next pass");
            Ok(ExitCode::SUCCESS)
        }
        Command::Compact { pool } => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            runtime.block_on(async {
                let client = kube_client().await?;
                gpuslice_operator::compaction::ask(&client, &pool).await?;
                println!(
                    "GpuPool/{pool}: compaction asked for; `kubectl get gpupool {pool} -o jsonpath='{{.status.compaction}}'` shows the round"
                );
                Ok(ExitCode::SUCCESS)
            })
        }
        Command::Operator {
            metrics_addr,
            lease_namespace,
            lease_duration,
            admission_params,
            agent_timeout,
        } => {
            let clock = gpuslice_planning::clock::Clock::from_env()?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            runtime.block_on(async {
                let client = kube_client().await?;
                let mut registry = prometheus_client::registry::Registry::default();
                let metrics = gpuslice_operator::controller::Metrics::register(&mut registry);
                // The loop passes at least every 5 minutes (it sleeps no longer between passes),
                // so twice that without a pass means it is stuck.
                const OPERATOR_STALE: std::time::Duration = std::time::Duration::from_secs(600);
                let telemetry =
                    gpuslice_runtime::telemetry::Telemetry::new(registry, OPERATOR_STALE);
                if let Some(addr) = metrics_addr {
                    telemetry
                        .serve(addr)
                        .await
                        .with_context(|| format!("serving metrics on {addr}"))?;
                }
                let namespace = lease_namespace
                    .or_else(|| std::env::var("POD_NAMESPACE").ok())
                    .unwrap_or_else(|| "default".into());
                let identity = std::env::var("POD_NAME").unwrap_or_else(|_| {
                    let host =
                        std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
                    format!("{}-{}", host.trim(), std::process::id())
                });
                let leadership = gpuslice_operator::election::start(
                    client.clone(),
                    &namespace,
                    "gpuslice-operator",
                    &identity,
                    lease_duration.into(),
                );
                tracing::info!("gpuslice operator: started as {identity}");
                gpuslice_operator::controller::run(
                    client,
                    clock,
                    metrics,
                    Some(telemetry),
                    leadership,
                    admission_params,
                    agent_timeout.into(),
                )
                .await?;
                anyhow::Ok(())
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench {
            which:
                Bench::Placement {
                    data,
                    seeds,
                    traces,
                    constrained,
                    variant_seed,
                },
        } => {
            use gpuslice_bench::placement as bench;
            let nodes = bench::cluster(&data)?;
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
                gpuslice_bench::placement::traces(&data)?
            } else {
                traces.iter().map(|t| data.join(t)).collect()
            };
            let mut results = Vec::new();
            for file in &files {
                results.push(gpuslice_bench::placement::run_trace(&nodes, file, seeds)?);
                eprintln!("replayed {}", file.display());
            }
            let (table, ok) = gpuslice_bench::placement::render(&results, seeds);
            Ok(print_table(&table, ok))
        }
        Command::Bench {
            which:
                Bench::Compute {
                    seconds,
                    scenarios,
                    no_overhead,
                    real_gpu,
                },
        } => {
            let (table, ok) = gpuslice_bench::compute::run_all(
                seconds.max(2),
                &scenarios,
                !no_overhead,
                real_gpu,
            )?;
            Ok(print_table(&table, ok))
        }
        Command::Bench {
            which:
                Bench::Compaction {
                    data,
                    load,
                    movable,
                    depart,
                    seed,
                },
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
        Command::Bench {
            which:
                Bench::Cache {
                    shards,
                    shard_mib,
                    source_mib,
                },
        } => {
            let (table, ok) = gpuslice_bench::cache::run(gpuslice_bench::cache::Plan {
                shards,
                shard_bytes: shard_mib << 20,
                source_rate: source_mib << 20,
            })?;
            Ok(print_table(&table, ok))
        }
        Command::Bench {
            which:
                Bench::ComputeWorker {
                    kernel_us,
                    seconds,
                    busy_ms,
                    idle_ms,
                    graph,
                    cooperative,
                    ex,
                    launches,
                    kernels,
                    iterations,
                    calibrate,
                    start_at,
                },
        } => {
            let report =
                gpuslice_bench::compute::worker::run(gpuslice_bench::compute::worker::Plan {
                    kernel_us,
                    seconds,
                    busy_ms,
                    idle_ms,
                    graph,
                    cooperative,
                    ex,
                    launches,
                    kernels,
                    iterations,
                    calibrate,
                    start_at,
                })
                .map_err(anyhow::Error::msg)?;
            println!("{report}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo {
            repo,
            clock,
            window_in,
        } => {
            use gpuslice_testcluster::demo::{Demo, DemoOptions};
            let options = DemoOptions {
                gpuslice: std::env::current_exe().context("finding the gpuslice binary")?,
                repo,
                clock,
                window_in: window_in.into(),
            };
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            runtime.block_on(async {
                eprintln!("starting the demo (about 20 s)…");
                let demo = Demo::start(&options).await?;
                println!("{}", demo.hints());
                let mut terminate =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                        .context("waiting for SIGTERM")?;
                tokio::select! {
                    stop = tokio::signal::ctrl_c() => stop.context("waiting for Ctrl-C")?,
                    _ = terminate.recv() => {}
                }
                eprintln!("stopping the demo and deleting {}", demo.dir().display());
                drop(demo);
                anyhow::Ok(())
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Crds { dir, check } => {
            let mut drifted = Vec::new();
            for kind in Kind::ALL {
                let file = dir.join(gpuslice_api::crd::file_name(kind));
                let want = gpuslice_api::crd::crd_yaml(kind);
                if check {
                    if std::fs::read_to_string(&file).ok().as_deref() != Some(want.as_str()) {
                        drifted.push(file.display().to_string());
                    }
                } else {
                    std::fs::create_dir_all(&dir)
                        .with_context(|| format!("creating {}", dir.display()))?;
                    std::fs::write(&file, want)
                        .with_context(|| format!("writing {}", file.display()))?;
                    println!("wrote {}", file.display());
                }
            }
            if drifted.is_empty() {
                Ok(ExitCode::SUCCESS)
            } else {
                for f in &drifted {
                    eprintln!(
                        "{f} differs from the API types; run `gpuslice crds` and commit the result"
                    );
                }
                Ok(ExitCode::FAILURE)
            }
        }
    }
}

/// Prints one standalone pass: in full with `--once`, else only when something changed.
fn show_pass(pass: &gpuslice_node::pass::Pass, once: bool, output: Output, shown: &mut String) {
    use std::io::Write as _;
    if once {
        for p in &pass.source.problems {
            eprintln!("{p}");
        }
    }
    match output {
        Output::Json if once => {
            println!("{}", serde_json::to_string_pretty(pass).unwrap_or_default())
        }
        Output::Json => println!("{}", serde_json::to_string(pass).unwrap_or_default()),
        Output::Text => {
            let body = gpuslice_node::render::render_body(pass);
            if once || body != *shown {
                print!("{}", gpuslice_node::render::render(pass));
                *shown = body;
            }
        }
    }
    if once && !pass.source.ok() {
        eprintln!(
            "{}",
            if pass.source.in_force {
                "the source was rejected; keeping the last good config"
            } else {
                "the source was rejected; nothing changed"
            }
        );
    }
    let _ = std::io::stdout().flush();
}

/// `gpuslice agent --kube`: the agent fed by its GpuNode, with /metrics and /healthz.
/// The Kubernetes client of the in-cluster config or KUBECONFIG.
async fn kube_client() -> anyhow::Result<kube::Client> {
    kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")
}

fn agent_in_cluster(
    node: gpuslice_api::NodeInventory,
    library: Option<PathBuf>,
    state: StateDir,
    clock: gpuslice_planning::clock::Clock,
    settings: gpuslice_node::cluster::Settings,
    watchdog: gpuslice_node::watchdog::Settings,
    metrics_addr: Option<std::net::SocketAddr>,
) -> anyhow::Result<()> {
    /// Healthy while a pass completed within this many intervals (plus a minute of slack).
    const STALE_INTERVALS: u32 = 3;
    const STALE_SLACK: std::time::Duration = std::time::Duration::from_secs(60);
    let gpus = gpuslice_node::NvmlGpus::open(library.as_deref())?;
    let agent = gpuslice_node::pass::Agent::new(gpus, &node, state, true)
        .with_faults(settings.faults.clone())
        .with_cache_root(settings.cache_root.clone())
        .with_watchdog(gpuslice_node::NvmlGpus::open(library.as_deref())?, watchdog);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let client = kube_client().await?;
        tracing::info!("gpuslice agent: node {} in the cluster", node.name);
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = gpuslice_node::cluster::Metrics::register(&mut registry);
        // XID errors come through NVML events, on a handle of their own.
        let counted = metrics.clone();
        let inbox = settings.faults.clone();
        match gpuslice_node::NvmlGpus::open(library.as_deref()).and_then(|gpus| {
            gpus.watch_xids(move |seen| {
                counted.count_xid(seen.gpu, seen.code);
                inbox.xid(seen);
            })
        }) {
            Ok(_) => tracing::info!("watching XID errors"),
            Err(e) => tracing::warn!("XID errors are not counted: {e}"),
        }
        let telemetry = gpuslice_runtime::telemetry::Telemetry::new(
            registry,
            settings.interval * STALE_INTERVALS + STALE_SLACK,
        );
        if let Some(addr) = metrics_addr {
            telemetry
                .serve(addr)
                .await
                .with_context(|| format!("serving metrics on {addr}"))?;
        }
        gpuslice_node::cluster::run(client, &agent, &clock, settings, metrics, Some(telemetry))
            .await?;
        anyhow::Ok(())
    })
}
