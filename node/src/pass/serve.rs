//! What a pass offers its slices once converged: dataset caches, the claims board with each
//! slice's I/O and host limits, checkpoints written, compute shares.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use gpuslice_planning::cluster::ClusterPlan;
use gpuslice_source::last_good::Config;

use super::{Agent, Pass, checkpoint_policy};
use crate::workloads::claims::{Claim, needs};
use crate::workloads::compute::{DEFAULT_TIME_SLICE, shares};

impl Agent {
    /// Offers the slices as this pass leaves them: the dataset caches, the claims board (with
    /// each slice's I/O and host limits), the checkpoints written, and each slice's compute share.
    pub(super) fn serve_slices(&self, pass: &mut Pass, config: &Config, now: DateTime<Utc>) {
        let slices = crate::gpu::slices::published(&self.state);
        let needs = needs(config);
        let pools = pass
            .plan
            .nodes
            .iter()
            .flat_map(|n| &n.gpus)
            .filter_map(|g| Some((g.index, g.pool()?.to_string())))
            .collect();
        let caches = local_caches(&pass.plan, config);
        let cached_gpus = gpu_pools(&pass.plan, config)
            .filter(|(_, pool, _)| caches.contains_key(*pool))
            .map(|(index, pool, _)| (index, pool.to_string()))
            .collect();
        self.socket.caches.set(&caches, cached_gpus);
        let bandwidth = bandwidths(&pass.plan, config);
        if !bandwidth.is_empty()
            && let Err(why) = &self.io
            && !self
                .io_warned
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!("I/O limits per slice are not applied: {why}");
        }
        self.socket
            .claims
            .set_limits(crate::workloads::claims::Limits {
                node: self.node.clone(),
                io: self.io.as_ref().ok().cloned(),
                host: self.host.clone(),
                bandwidth: bandwidth.clone(),
                checkpointing: gpu_pools(&pass.plan, config)
                    .filter_map(|(index, _, spec)| {
                        let policy = config.checkpoints.get(spec.checkpoint_policy.as_ref()?)?;
                        Some((index, crate::workloads::claims::checkpointing(policy)))
                    })
                    .collect(),
            });
        self.socket
            .claims
            .update(slices.clone(), pools, needs.clone(), self.pinned());
        pass.claims = self.socket.claims.held();
        pass.checkpoints = pass
            .claims
            .iter()
            .filter_map(|c| {
                let marker = self.state.checkpoint_done(&c.slice);
                let written = std::fs::metadata(marker).ok()?.modified().ok()?;
                Some((c.slice.clone(), DateTime::<Utc>::from(written)))
            })
            .collect();
        pass.overdue = self.overdue(pass, config, now);
        // The slices `gpuslice run` holds: their cgroups stay, the others' go.
        let running: Vec<String> = pass
            .claims
            .iter()
            .filter(|c| c.resource_claim.is_none())
            .map(|c| c.slice.clone())
            .collect();
        if self.apply
            && let Ok(io) = &self.io
        {
            limit_pods(io, &slices, &pass.claims, &bandwidth);
            io.remove_run_groups_except(&self.node, &running);
        }
        if self.apply
            && let Some(host) = &self.host
        {
            host.remove_except(&self.node, &running);
        }
        pass.shares = shares(&slices, &pass.claims, &needs, &time_slices(&pass.plan));
        self.socket.compute.set(&pass.shares);
        pass.idle_since = self.idle_since(&pass.claims, now);
    }

    /// The held workloads newly past their CheckpointPolicy's interval.
    fn overdue(
        &self,
        pass: &Pass,
        config: &Config,
        now: DateTime<Utc>,
    ) -> Vec<crate::workloads::interval::Overdue> {
        let watched: Vec<crate::workloads::interval::Watched> = pass
            .claims
            .iter()
            .filter_map(|c| {
                let policy = checkpoint_policy(pass, config, Some(c), &c.slice)?;
                Some(crate::workloads::interval::Watched {
                    slice: c.slice.clone(),
                    holder: c
                        .resource_claim
                        .clone()
                        .unwrap_or_else(|| c.workload.unwrap_or(c.client).to_string()),
                    interval: policy.interval?,
                    policy: policy.name,
                    last_checkpoint: pass.checkpoints.get(&c.slice).copied(),
                })
            })
            .collect();
        let mut watch = self.intervals.lock().unwrap_or_else(|p| p.into_inner());
        watch.check(&watched, now)
    }
}

/// Each planned GPU with its pool's name and spec (GPUs in no pool, or in a pool the config
/// lacks, are left out).
fn gpu_pools<'a>(
    plan: &'a ClusterPlan,
    config: &'a Config,
) -> impl Iterator<Item = (u32, &'a str, &'a gpuslice_api::GpuPoolSpec)> + 'a {
    plan.nodes.iter().flat_map(|n| &n.gpus).filter_map(|gpu| {
        let pool = gpu.pool()?;
        let spec = &config
            .pools
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(pool))?
            .spec;
        Some((gpu.index, pool, spec))
    })
}

/// The dataset caches of the pools with GPUs on this node: pool → path and size.
fn local_caches(
    plan: &ClusterPlan,
    config: &Config,
) -> BTreeMap<String, crate::protections::cache::CacheSpec> {
    gpu_pools(plan, config)
        .filter_map(|(_, pool, spec)| {
            let cache = spec.io.as_ref()?.local_cache.as_ref()?;
            let size = cache
                .size
                .as_ref()
                .and_then(|s| gpuslice_api::bytes_of(&s.0).ok());
            Some((
                pool.to_string(),
                crate::protections::cache::CacheSpec {
                    path: std::path::PathBuf::from(&cache.path),
                    size,
                    sources: cache.sources.clone(),
                },
            ))
        })
        .collect()
}

/// Each GPU's I/O limit per slice (bytes/s): its pool's `io.bandwidthPerSlice`.
fn bandwidths(plan: &ClusterPlan, config: &Config) -> BTreeMap<u32, u64> {
    gpu_pools(plan, config)
        .filter_map(|(index, _, spec)| {
            Some((index, crate::protections::iolimit::bandwidth_of(spec)?))
        })
        .collect()
}

/// Limits the cgroups of the pods holding prepared claims on GPUs with an I/O limit (each
/// pass: a pod's cgroup appears when its sandbox starts, after the claim was prepared).
fn limit_pods(
    io: &crate::protections::iolimit::Cgroups,
    slices: &[gpuslice_contract::SliceConfig],
    claims: &[Claim],
    bandwidth: &BTreeMap<u32, u64>,
) {
    for claim in claims.iter().filter(|c| c.resource_claim.is_some()) {
        let Some(limit) = slices
            .iter()
            .find(|s| s.id == claim.slice)
            .and_then(|s| bandwidth.get(&s.gpu))
        else {
            continue;
        };
        for uid in &claim.pods {
            for group in io.pod_groups(uid) {
                if let Err(e) = io.limit(&group, *limit) {
                    tracing::warn!("pod {uid}: the I/O limit is not applied: {e}");
                }
            }
        }
    }
}

/// Each GPU's minimum compute slice: its pool's `timeSlice`.
fn time_slices(plan: &ClusterPlan) -> BTreeMap<u32, Duration> {
    plan.nodes
        .iter()
        .flat_map(|n| &n.gpus)
        .map(|gpu| {
            let slice = (gpu.assigned.as_ref().and_then(|a| a.time_slice))
                .map_or(DEFAULT_TIME_SLICE, Duration::from);
            (gpu.index, slice)
        })
        .collect()
}
