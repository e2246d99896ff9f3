//! One module per subcommand: its arguments (clap) and what it runs.

pub mod agent;
#[cfg(feature = "dev")]
pub mod bench;
pub mod crds;
#[cfg(feature = "dev")]
pub mod demo;
pub mod local;
pub mod operator;
pub mod plan;
pub mod validate;

use anyhow::Context as _;

/// How `validate` and a standalone `agent` print.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Output {
    Text,
    Json,
}

/// A tokio runtime: on one thread for what runs one loop (the agent, a one-off request), on
/// several for the operator's concurrent controllers.
pub fn tokio_runtime(threads: Threads) -> anyhow::Result<tokio::runtime::Runtime> {
    match threads {
        Threads::One => tokio::runtime::Builder::new_current_thread(),
        Threads::Many => tokio::runtime::Builder::new_multi_thread(),
    }
    .enable_all()
    .build()
    .context("starting the async runtime")
}

#[derive(Clone, Copy)]
pub enum Threads {
    One,
    Many,
}

/// The Kubernetes client of the in-cluster config or KUBECONFIG.
pub async fn kube_client() -> anyhow::Result<kube::Client> {
    kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")
}
