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

/// The Kubernetes client of the in-cluster config or KUBECONFIG.
pub async fn kube_client() -> anyhow::Result<kube::Client> {
    kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")
}
