//! `gpuslice demo` (developer build): the cluster path on this machine, with emulated nodes.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;

/// Try the cluster path on this machine: a private Kubernetes control plane with fake nodes
/// for the example pools, the chart's CRDs, roles and admission policies, the operator and an
/// emulated agent per node as local processes, examples/gitops applied. Prints the
/// KUBECONFIG and what to try; Ctrl-C stops everything and deletes its folder. Needs
/// `bash tests/controlplane/build.sh` and `bash tests/helm/build.sh` once.
#[derive(clap::Args)]
pub struct Args {
    /// The checkout whose crds/, charts/gpuslice and examples/gitops are used.
    #[arg(long, default_value = env!("CARGO_MANIFEST_DIR"))]
    pub repo: PathBuf,
    /// Start the operator's and agents' clock here (RFC 3339) instead of shortly before the
    /// example pools' next window change.
    #[arg(long)]
    pub clock: Option<chrono::DateTime<chrono::FixedOffset>>,
    /// How long after the start the example pools' next window change comes (without --clock).
    #[arg(long, default_value = "5m")]
    pub window_in: gpuslice_api::Duration,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let Args {
        repo,
        clock,
        window_in,
    } = args;
    use gpuslice_testcluster::demo::{Demo, DemoOptions};
    let options = DemoOptions {
        gpuslice: std::env::current_exe().context("finding the gpuslice binary")?,
        repo,
        clock,
        window_in: window_in.into(),
    };
    let runtime = super::tokio_runtime(super::Threads::Many)?;
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
