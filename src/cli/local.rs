//! The commands that ask this node's agent over its socket: `gpuslice run`, `gpuslice cache`,
//! `gpuslice gpu-reset`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use gpuslice_contract::StateDir;

/// Run a command on a slice of this node: ask the agent for one that fits (waiting in line
/// when none is free), run the command under the shim with the slice's limits, give the slice
/// back when it ends.
#[derive(clap::Args)]
pub struct RunArgs {
    /// The agent's state directory.
    #[arg(long, default_value = gpuslice_contract::paths::DEFAULT)]
    pub state: PathBuf,
    /// A GpuSlicePolicy of the agent's source: its memory (plus the pool's headroom) and
    /// compute limit.
    #[arg(long)]
    pub policy: Option<String>,
    /// GPU memory the command needs, e.g. 20Gi.
    #[arg(long)]
    pub memory: Option<String>,
    /// Compute share the command needs, in percent of a GPU.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub compute: Option<u32>,
    /// Fail at once when no slice is free instead of waiting in line.
    #[arg(long)]
    pub no_wait: bool,
    /// The shim to preload (default: libgpuslice.so next to gpuslice).
    #[arg(long)]
    pub shim: Option<PathBuf>,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let RunArgs {
        state,
        policy,
        memory,
        compute,
        no_wait,
        shim,
        command,
    } = args;
    let memory_bytes = memory
        .map(|m| gpuslice_api::bytes_of(&m).with_context(|| format!("--memory {m:?}")))
        .transpose()?;
    let want = gpuslice_contract::socket::Want {
        policy,
        memory_bytes,
        compute_percent: compute,
        no_wait,
        slice: None,
    };
    let shim = match shim {
        Some(s) => s,
        None => gpuslice::run::shim_library()?,
    };
    let code = gpuslice::run::run(&StateDir::new(state), &want, &shim, &command)?;
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}

/// A dataset file through this node's local cache (a pool's io.localCache): prints the local,
/// read-only path with the source's bytes, fetched once for all who ask.
#[derive(clap::Args)]
pub struct CacheArgs {
    /// An absolute path (a mounted dataset) or an http:// URL.
    pub source: String,
    /// The pool whose cache, when the node has several.
    #[arg(long)]
    pub pool: Option<String>,
    /// The agent's state directory.
    #[arg(long, default_value = gpuslice_contract::paths::DEFAULT)]
    pub state: PathBuf,
}

pub fn cache(args: CacheArgs) -> anyhow::Result<ExitCode> {
    let CacheArgs {
        source,
        pool,
        state,
    } = args;
    let (path, hit) = gpuslice::run::cache_fetch(&StateDir::new(state), &source, pool.as_deref())?;
    eprintln!("gpuslice cache: {}", if hit { "cached" } else { "fetched" });
    println!("{}", path.display());
    Ok(ExitCode::SUCCESS)
}

/// Tell this node's agent that GPUs were reset (after `nvidia-smi -r`), so that it lifts
/// their XID quarantines: `1`, `0,3` or `all`. Root only. In a cluster, annotating the
/// GpuNode `gpuslice.io/gpu-reset=<gpus>` does the same.
#[derive(clap::Args)]
pub struct GpuResetArgs {
    pub gpus: String,
    /// The agent's state directory.
    #[arg(long, default_value = gpuslice_contract::paths::DEFAULT)]
    pub state: PathBuf,
}

pub fn gpu_reset(args: GpuResetArgs) -> anyhow::Result<ExitCode> {
    let GpuResetArgs { gpus, state } = args;
    gpuslice::run::gpu_reset(&StateDir::new(state), &gpus)?;
    println!("GPU(s) {gpus}: the agent lifts their quarantines at its next pass");
    Ok(ExitCode::SUCCESS)
}
