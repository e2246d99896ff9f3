//! `gpuslice agent`: the node agent, standalone (a folder or Git repository) or in a cluster
//! (its GpuNode), on real GPUs or (developer build) an emulated node.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use gpuslice_contract::StateDir;
use gpuslice_source::SourceSpec;

use super::{Output, kube_client};

/// The node agent. Standalone: converge this node's GPUs to the pools of a folder or Git
/// repository, every interval and at each window boundary (or once, with --once).
#[derive(clap::Args)]
pub struct Args {
    /// A folder, a YAML file, a local Git repository or a Git URL holding the pools. Git
    /// sources are fetched on every pass; a bad commit leaves the last good config in force.
    #[arg(long, required_unless_present = "kube", conflicts_with = "kube")]
    pub source: Option<String>,
    /// In a cluster: apply this node's GpuNode (written by the operator) and report its
    /// status, instead of reading pools from a source. Uses the in-cluster config or
    /// KUBECONFIG; the node name comes from --node-name, NODE_NAME or the host name.
    #[arg(long)]
    pub kube: bool,
    /// With --kube: serve /metrics and /healthz here (e.g. 0.0.0.0:8081).
    #[arg(long, requires = "kube")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Git branch, tag or commit to follow (the remote's default branch when omitted).
    #[arg(long = "ref")]
    pub git_ref: Option<String>,
    /// Sub-folder of the source to read.
    #[arg(long)]
    pub path: Option<String>,
    /// This node's name and labels, as a NodeInventory YAML (name, labels).
    #[arg(long)]
    pub node_file: Option<PathBuf>,
    /// This node's name (default: from the node's file, else the host name).
    #[arg(long)]
    pub node_name: Option<String>,
    /// A node label pools select on, key=value; repeat for more. Added to the node file's.
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    #[cfg(feature = "dev")]
    #[command(flatten)]
    pub emulation: Emulation,
    /// Load NVML from this library instead of the system's libnvidia-ml.so.1.
    #[arg(long)]
    pub nvml: Option<PathBuf>,
    /// The agent's state directory (slice tables and configs, the last good source, drain
    /// records).
    #[arg(long, default_value = gpuslice_contract::paths::DEFAULT)]
    pub state: PathBuf,
    /// Change the GPUs; without it the agent only reports what it would do.
    #[arg(long)]
    pub apply: bool,
    /// Where the pools' dataset caches (`io.localCache.path`, a folder under
    /// /var/lib/gpuslice/cache) are kept: this folder stands for /var/lib/gpuslice/cache.
    #[arg(long, default_value = gpuslice_api::CACHE_ROOT)]
    pub cache_root: PathBuf,
    /// Run one pass and exit.
    #[arg(long)]
    pub once: bool,
    /// How often to fetch the source and reconcile (Go duration).
    #[arg(long, default_value = "30s")]
    pub interval: gpuslice_api::Duration,
    /// With --kube: taint a GPU's DRA devices (gpuslice.io/recut, NoSchedule) this long before
    /// a window change re-cuts it, so that no new pod lands on a slice about to go.
    #[arg(long, default_value = "10m", requires = "kube")]
    pub recut_lookahead: gpuslice_api::Duration,
    /// With --kube: serve the DRA kubelet plugin (driver gpuslice.io) for the kubelet whose
    /// root directory this is (registration in <dir>/plugins_registry), e.g. /var/lib/kubelet.
    #[arg(long, requires = "kube")]
    pub kubelet_dir: Option<PathBuf>,
    /// Where the container runtime reads CDI specs; the plugin writes one per prepared claim.
    #[arg(long, default_value = "/var/run/cdi", requires = "kubelet_dir")]
    pub cdi_dir: PathBuf,
    /// The kernel log whose NVRM XID records name the process that caused an XID (NVML's
    /// events do not), so that fault isolation quarantines its slice.
    #[arg(long, default_value = "/dev/kmsg")]
    pub kernel_log: PathBuf,
    /// How often the memory watchdog reads each process's GPU memory from NVML: a software
    /// slice holding more than its cap (a workload that bypassed the shim) has its biggest
    /// process sent SIGTERM.
    #[arg(long, default_value = "1s")]
    pub memory_watchdog_interval: gpuslice_api::Duration,
    /// From the watchdog's SIGTERM to SIGKILL while the slice stays over its cap; 0s kills
    /// at once.
    #[arg(long, default_value = "5s")]
    pub memory_watchdog_grace: gpuslice_api::Duration,
    /// What the watchdog does about a process on a pool's GPU that holds no slice of that GPU
    /// (a workload given the GPU past its slice, e.g. by NVIDIA_VISIBLE_DEVICES in its image or
    /// envFrom; a host user outside `gpuslice run`): stop it as it stops an overrun, or only
    /// report it (log, metric, Event on its pod). GPUs in no pool are not watched.
    #[arg(long, value_enum, default_value_t = StrayProcesses::Stop)]
    pub stray_processes: StrayProcesses,
    /// NVIDIA's MPS control tool, which the agent runs (`-d`) for each GPU with an `mps`
    /// layout; default: nvidia-cuda-mps-control on PATH (in a developer build with --emulate, the emulated one).
    #[arg(long)]
    pub mps_control: Option<PathBuf>,
    /// The instant to plan for (RFC 3339), with --once; now by default.
    #[arg(long, requires = "once")]
    pub at: Option<chrono::DateTime<chrono::FixedOffset>>,
    #[arg(long, short, value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

/// What the watchdog does about stray GPU processes.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum StrayProcesses {
    Stop,
    Report,
}

/// The developer build's emulated node.
#[cfg(feature = "dev")]
#[derive(clap::Args)]
pub struct Emulation {
    /// Run against an emulated node described by this NodeInventory YAML instead of real GPUs
    /// (its name and labels too; the emulated machine is kept in the state directory).
    #[arg(long, conflicts_with = "nvml")]
    pub emulate: Option<PathBuf>,
    /// With --emulate: where the emulated machine keeps its state (the emulated driver, which
    /// containers share through a host path) instead of the state directory's
    /// `emulated-<node>.json`.
    #[arg(long, requires = "emulate")]
    pub emulator_state: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    #[cfg(feature = "dev")]
    let emulation = args.emulation;
    let Args {
        source,
        kube,
        metrics_addr,
        git_ref,
        path,
        node_file,
        node_name,
        labels,
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
        stray_processes,
        mps_control,
        at,
        output,
        ..
    } = args;
    let watchdog = gpuslice_node::protections::watchdog::Settings {
        interval: memory_watchdog_interval.into(),
        grace: memory_watchdog_grace.into(),
        strays: match stray_processes {
            StrayProcesses::Stop => gpuslice_node::protections::watchdog::StrayAction::Stop,
            StrayProcesses::Report => gpuslice_node::protections::watchdog::StrayAction::Report,
        },
    };
    let clock = gpuslice_runtime::clock::Clock::from_env()?;
    #[cfg(feature = "dev")]
    let emulate = emulation.emulate.as_ref();
    #[cfg(not(feature = "dev"))]
    let emulate: Option<&PathBuf> = None;
    let node = this_node(emulate.or(node_file.as_ref()), node_name, labels)?;
    let state = StateDir::new(state);
    #[cfg(feature = "dev")]
    let library = match emulate {
        Some(_) => Some(emulated_nvml(emulation.emulator_state, &state, &node)?),
        None => nvml,
    };
    #[cfg(not(feature = "dev"))]
    let library = nvml;
    #[cfg(feature = "dev")]
    let mps_control = match (mps_control, emulate) {
        (Some(tool), _) => tool,
        (None, Some(_)) => gpuslice_node::gpu::emulate::emulated_mps_control(),
        (None, None) => PathBuf::from(gpuslice_node::gpu::mps::DEFAULT_CONTROL),
    };
    #[cfg(not(feature = "dev"))]
    let mps_control =
        mps_control.unwrap_or_else(|| PathBuf::from(gpuslice_node::gpu::mps::DEFAULT_CONTROL));
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
            faults: gpuslice_node::protections::faults::Inbox::default(),
            cache_root,
            mps_control,
        };
        match gpuslice_node::protections::faults::follow_kernel_log(
            &kernel_log,
            settings.faults.clone(),
        ) {
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
        mps_control,
    };
    let mut shown = String::new();
    let last =
        gpuslice_node::standalone::run(&options, |pass| show_pass(pass, once, output, &mut shown))?;
    Ok(if last.failed() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// This node as the agent sees it: the node file's (or the emulated node's) name and labels,
/// the name from --node-name, NODE_NAME or the host name, and the --label flags.
fn this_node(
    file: Option<&PathBuf>,
    name: Option<String>,
    labels: Vec<(String, String)>,
) -> anyhow::Result<gpuslice_api::NodeInventory> {
    let name = name.or_else(|| std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty()));
    let mut node = match file {
        Some(file) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?;
            serde_yaml::from_str::<gpuslice_api::NodeInventory>(&text)
                .with_context(|| format!("{}: not a NodeInventory", file.display()))?
        }
        None => gpuslice_api::NodeInventory::default(),
    };
    if let Some(name) = name {
        node.name = name;
    }
    if node.name.is_empty() {
        node.name = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .context("no node name: give --node-name or --node-file")?;
    }
    node.labels.extend(labels);
    Ok(node)
}

/// The emulated NVML library, its machine seeded from the node (kept in `machine`, else in the
/// state directory).
#[cfg(feature = "dev")]
fn emulated_nvml(
    machine: Option<PathBuf>,
    state: &StateDir,
    node: &gpuslice_api::NodeInventory,
) -> anyhow::Result<PathBuf> {
    let machine = machine.unwrap_or_else(|| state.emulated_machine(&node.name));
    gpuslice_node::gpu::emulate::prepare_emulator(&machine, node)?;
    Ok(gpuslice_node::gpu::emulate::emulator_library()?)
}

fn parse_label(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("{text:?}: a label is key=value"))
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
fn agent_in_cluster(
    node: gpuslice_api::NodeInventory,
    library: Option<PathBuf>,
    state: StateDir,
    clock: gpuslice_runtime::clock::Clock,
    settings: gpuslice_node::cluster::Settings,
    watchdog: gpuslice_node::protections::watchdog::Settings,
    metrics_addr: Option<std::net::SocketAddr>,
) -> anyhow::Result<()> {
    /// Healthy while a pass completed within this many intervals (plus a minute of slack).
    const STALE_INTERVALS: u32 = 3;
    const STALE_SLACK: std::time::Duration = std::time::Duration::from_secs(60);
    let gpus = gpuslice_node::NvmlGpus::open(library.as_deref())?;
    let agent = gpuslice_node::pass::Agent::new(gpus, &node, state, true)
        .with_faults(settings.faults.clone())
        .with_cache_root(settings.cache_root.clone())
        .with_mps_control(settings.mps_control.clone())
        .with_watchdog(gpuslice_node::NvmlGpus::open(library.as_deref())?, watchdog);
    let runtime = super::tokio_runtime(super::Threads::One)?;
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
