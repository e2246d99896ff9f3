//! `gpuslice operator` and the one request a person makes of it, `gpuslice compact`.

use std::process::ExitCode;

use super::kube_client;
use anyhow::Context as _;

/// The operator: reconcile GpuPools into each node's desired layout (GpuNode) and pool status.
/// Uses the in-cluster config or KUBECONFIG.
#[derive(clap::Args)]
pub struct Args {
    /// Serve /metrics and /healthz here (e.g. 0.0.0.0:8080).
    #[arg(long)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The namespace of the leader-election Lease (default: POD_NAMESPACE, else default).
    #[arg(long)]
    pub lease_namespace: Option<String>,
    /// How long a leader's lease lasts without renewal (Go duration).
    #[arg(long, default_value = "15s")]
    pub lease_duration: gpuslice_api::Duration,
    /// Keep the admission policy's parameters in this ConfigMap (NAMESPACE/NAME): each
    /// GpuSlicePolicy and the namespaces its namespaceSelector lets use it. The chart sets it.
    #[arg(long, value_parser = parse_object_ref)]
    pub admission_params: Option<gpuslice_operator::controller::AdmissionParams>,
    /// How long a node's agent may leave a preemption in its GpuNode unread before the
    /// waiting pod and the pool (a Warning Event) say so; after five times as long the
    /// preemption is given up and the claim left alone for 10 minutes.
    #[arg(long, default_value = "60s")]
    pub agent_timeout: gpuslice_api::Duration,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let Args {
        metrics_addr,
        lease_namespace,
        lease_duration,
        admission_params,
        agent_timeout,
    } = args;
    let clock = gpuslice_runtime::clock::Clock::from_env()?;
    let runtime = super::tokio_runtime(super::Threads::Many)?;
    runtime.block_on(async {
        let client = kube_client().await?;
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = gpuslice_operator::controller::Metrics::register(&mut registry);
        // The loop passes at least every 5 minutes (it sleeps no longer between passes),
        // so twice that without a pass means it is stuck.
        const OPERATOR_STALE: std::time::Duration = std::time::Duration::from_secs(600);
        let telemetry = gpuslice_runtime::telemetry::Telemetry::new(registry, OPERATOR_STALE);
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
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
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

/// Ask the operator to compact a pool now, outside its compaction window: annotates the
/// GpuPool gpuslice.io/compact-now; the round shows in its status.compaction. Uses the
/// in-cluster config or KUBECONFIG.
#[derive(clap::Args)]
pub struct CompactArgs {
    /// The GpuPool (its spec.compaction must be enabled).
    pub pool: String,
}

pub fn compact(args: CompactArgs) -> anyhow::Result<ExitCode> {
    let CompactArgs { pool } = args;
    let runtime = super::tokio_runtime(super::Threads::One)?;
    runtime.block_on(async {
        let client = kube_client().await?;
        gpuslice_operator::compaction::ask(&client, &pool).await?;
        println!(
            "GpuPool/{pool}: compaction asked for; `kubectl get gpupool {pool} -o jsonpath='{{.status.compaction}}'` shows the round"
        );
        Ok(ExitCode::SUCCESS)
    })
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
