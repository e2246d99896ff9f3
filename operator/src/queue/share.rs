//! Fair share: each namespace's decayed use of a pool, its share of the pool this pass, and the
//! use recorded in the pool's `status.fairShare`, from which a new leader starts.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use gpuslice_api::{FairShareStatus, GpuPool, NamespaceUsage};
use gpuslice_planning::queue::{self, Share, Waiting};
use kube::ResourceExt as _;

use super::cluster::PoolPass;

/// Half-life of namespaces' usage when the pool declares none.
const DEFAULT_HALF_LIFE_SECONDS: f64 = 3600.0;

/// How often each pool's `status.fairShare` is written: a new leader carries on from it, so at
/// most this much of accounting is lost.
const FAIR_SHARE_EVERY_SECONDS: i64 = 10;

/// The use each pool's status records, decayed to `wall` (a new leader starts from it).
pub(super) fn recorded_usage(
    pools: &[Arc<GpuPool>],
    wall: chrono::DateTime<chrono::Utc>,
) -> BTreeMap<(String, String), f64> {
    let mut out = BTreeMap::new();
    for pool in pools {
        let Some(recorded) = pool.status.as_ref().and_then(|s| s.fair_share.as_ref()) else {
            continue;
        };
        let half_life = pool
            .spec
            .scheduling
            .as_ref()
            .and_then(|s| s.half_life)
            .map_or(DEFAULT_HALF_LIFE_SECONDS, |d| {
                std::time::Duration::from(d).as_secs_f64()
            });
        let age = gpuslice_api::chrono_of(&recorded.at).map_or(0.0, |at| {
            (wall - at).num_milliseconds().max(0) as f64 / 1000.0
        });
        for n in &recorded.namespaces {
            out.insert(
                (pool.name_any(), n.namespace.clone()),
                queue::decay(n.slice_seconds.max(0) as f64, 0, age, half_life),
            );
        }
    }
    out
}

impl PoolPass<'_> {
    /// Each namespace's share of the pool this pass (its weight, the slices it holds, its use),
    /// its `usage` (per pool and namespace) decayed by the `elapsed` seconds; the use of idle
    /// namespaces that has faded is forgotten.
    pub(super) fn shares(
        &self,
        usage: &mut BTreeMap<(String, String), f64>,
        waiting: &[Waiting],
        elapsed: f64,
    ) -> BTreeMap<String, Share> {
        let pool_name = &self.name;
        let scheduling = &self.scheduling;
        let half_life = scheduling.half_life.map_or(DEFAULT_HALF_LIFE_SECONDS, |d| {
            std::time::Duration::from(d).as_secs_f64()
        });
        let namespaces: BTreeSet<String> = waiting
            .iter()
            .map(|w| w.namespace.clone())
            .chain(
                self.pass
                    .holding
                    .keys()
                    .filter(|(p, _)| p == pool_name)
                    .map(|(_, ns)| ns.clone()),
            )
            .chain(scheduling.weights.keys().cloned())
            // Past use keeps decaying while a namespace neither holds nor waits.
            .chain(
                usage
                    .keys()
                    .filter(|(p, _)| p == pool_name)
                    .map(|(_, ns)| ns.clone()),
            )
            .collect();
        let mut shares = BTreeMap::new();
        for ns in namespaces {
            let held = self
                .pass
                .holding
                .get(&(pool_name.clone(), ns.clone()))
                .copied()
                .unwrap_or(0);
            let used = usage.entry((pool_name.clone(), ns.clone())).or_insert(0.0);
            *used = queue::decay(*used, held, elapsed, half_life);
            shares.insert(
                ns.clone(),
                Share {
                    weight: f64::from(scheduling.weights.get(&ns).copied().unwrap_or(1)),
                    holding: held,
                    usage: *used,
                },
            );
        }
        // Forgotten once it has decayed below a slice-second and the namespace is idle.
        usage.retain(|(p, ns), u| {
            p != pool_name
                || *u >= 1.0
                || shares.get(ns).is_some_and(|s: &Share| s.holding > 0)
                || scheduling.weights.contains_key(ns)
                || waiting.iter().any(|w| w.namespace == *ns)
        });
        shares
    }

    /// The namespaces' use to record in the pool's status, when what it records is
    /// [`FAIR_SHARE_EVERY_SECONDS`] old or more (or nothing).
    pub(super) fn fair_share(&self, shares: &BTreeMap<String, Share>) -> Option<FairShareStatus> {
        let wall = self.pass.wall;
        let recorded = self
            .pool
            .status
            .as_ref()
            .and_then(|s| s.fair_share.as_ref())
            .and_then(|f| gpuslice_api::chrono_of(&f.at));
        let stale = recorded.is_none_or(|at| (wall - at).num_seconds() >= FAIR_SHARE_EVERY_SECONDS);
        if !stale || shares.is_empty() {
            return None;
        }
        let at = gpuslice_api::time_of(wall)?;
        Some(FairShareStatus {
            at,
            namespaces: shares
                .iter()
                .map(|(ns, share)| NamespaceUsage {
                    namespace: ns.clone(),
                    slice_seconds: share.usage.round() as i64,
                    holding: share.holding,
                    weight: share.weight as u32,
                })
                .collect(),
        })
    }
}
