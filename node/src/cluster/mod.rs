//! Cluster mode (`gpuslice agent --kube`): the source is this node's `GpuNode` (written by the
//! operator) with the policies claims may name, read from the API; the sink is
//! `GpuNode.status`: the inventory, the generation applied, and `Ready` / `Blocked` conditions.
//! The agent owns the status under its own field manager and states all of it in every apply.
//! Passes are the standalone agent's: claims, drains and compute shares work the same. After each
//! pass the slices in force are published as DRA devices ([`crate::cluster::dra`]) in ResourceSlices the
//! Node owns, written only when a device changed.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::StreamExt as _;
use gpuslice_api::k8s_openapi::api::core::v1::ObjectReference;
use gpuslice_api::k8s_openapi::api::resource::v1::Device;
use gpuslice_api::{CheckpointPolicy, DriverMinimum, GpuNode, GpuPool, GpuSlicePolicy};
use gpuslice_planning::cluster::{ClusterPlan, NodePlan};
use gpuslice_runtime::apply_body;
use gpuslice_runtime::clock::Clock;
use gpuslice_runtime::telemetry::Telemetry;
use gpuslice_source::last_good::Config;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::watcher;

use crate::pass::{Agent, Intent, Pass, PassError};
use crate::protections::faults::{self, Notice, Quarantines};

pub mod dra;
mod evictions;
mod isolation;
mod metrics;
mod publish;
mod status;

use evictions::StrayPods;
use evictions::{ask_evictions, recut_devices, stale_allocations, unprepared_victims};
use isolation::{isolate_faults, tell_faults, tell_overdue, tell_overrun};
use status::{driver_check, io_condition, plan_spec, quarantine_condition, status};

pub use metrics::{Metrics, Readings};
pub use publish::Publisher;

/// The field manager of what the agent writes.
pub const MANAGER: &str = "gpuslice-agent";
/// While a transition waits for busy processes, pass again at least this often.
const BLOCKED_RETRY: Duration = Duration::from_secs(5);
/// The shortest wait between passes.
const MIN_WAIT: Duration = Duration::from_millis(200);
/// After a staged switch at a window boundary, how long a status that only says so (the slices
/// in force, `appliedSwitch`) waits: the operator writes the new layout as the spec 20 s after
/// the boundary, and the one write that answers it reports both. So a thousand nodes switching
/// at once write only their ResourceSlices then, which the scheduler waits for.
const SWITCH_REPORT_AFTER: chrono::TimeDelta = chrono::TimeDelta::seconds(40);

/// Why the agent stopped.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("GpuNode/{node}: {source}")]
    Kube { node: String, source: kube::Error },
    #[error(transparent)]
    Pass(#[from] PassError),
    #[error(transparent)]
    Faults(#[from] faults::FaultError),
}

/// The policies claims may name, their pools' headroom, and the checkpoint policies drains
/// follow, as the API has them now. A list that fails leaves that part empty (claims naming a
/// policy are then refused, drains wait) and is retried next pass.
async fn read_config(client: &Client) -> Config {
    let params = ListParams::default();
    let pools = Api::<GpuPool>::all(client.clone()).list(&params).await;
    let policies = Api::<GpuSlicePolicy>::all(client.clone())
        .list(&params)
        .await;
    let checkpoints = Api::<CheckpointPolicy>::all(client.clone())
        .list(&params)
        .await;
    for (kind, e) in [
        ("GpuPool", pools.as_ref().err()),
        ("GpuSlicePolicy", policies.as_ref().err()),
        ("CheckpointPolicy", checkpoints.as_ref().err()),
    ] {
        if let Some(e) = e {
            tracing::warn!("listing {kind}: {e}");
        }
    }
    Config {
        pools: pools.map(|l| l.items).unwrap_or_default(),
        policies: by_name(policies, |p| (p.metadata.name, p.spec)),
        checkpoints: by_name(checkpoints, |c| (c.metadata.name, c.spec)),
        revision: None,
    }
}

/// The specs of a list's objects by name (none where the list failed).
fn by_name<K, S>(
    list: Result<kube::api::ObjectList<K>, kube::Error>,
    parts: impl Fn(K) -> (Option<String>, S),
) -> std::collections::BTreeMap<String, S>
where
    K: Clone,
{
    list.map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|k| match parts(k) {
            (Some(name), spec) => Some((name, spec)),
            (None, _) => None,
        })
        .collect()
}

/// How the agent runs in a cluster.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Pass at least this often (processes come and go).
    pub interval: Duration,
    /// Taint a GPU's devices this long before a window change re-cuts it.
    pub recut_lookahead: Duration,
    /// Serve the DRA kubelet plugin with these paths.
    pub kubelet: Option<crate::kubelet::Paths>,
    /// XID errors (and the kernel's records of them) as the watcher threads receive them.
    pub faults: faults::Inbox,
    /// Where `/var/lib/gpuslice/cache`, the pools' dataset caches' root, is.
    pub cache_root: std::path::PathBuf,
    /// NVIDIA's MPS control tool, which runs GPUs' MPS daemons (`mps` layouts).
    pub mps_control: std::path::PathBuf,
}

/// Runs the agent until the process ends: a pass whenever its GpuNode changes, every
/// `interval` (processes come and go), and sooner while a transition waits for busy processes.
pub async fn run(
    client: Client,
    agent: &Agent,
    clock: &Clock,
    settings: Settings,
    metrics: Metrics,
    telemetry: Option<Telemetry>,
) -> Result<(), ClusterError> {
    let mut node = NodeLoop::start(client, agent, clock, settings, metrics, telemetry).await?;
    let changes = watcher(
        node.api.clone(),
        watcher::Config::default().fields(&format!("metadata.name={}", node.name)),
    );
    futures::pin_mut!(changes);
    loop {
        let wake = node.turn().await?;
        let _ = tokio::time::timeout(wake, async {
            tokio::select! {
                _ = changes.next() => {}
                _ = node.settings.faults.changed() => {}
            }
        })
        .await;
    }
}

/// What the node's loop keeps from one pass to the next.
struct NodeLoop<'a> {
    client: Client,
    agent: &'a Agent,
    clock: &'a Clock,
    settings: Settings,
    metrics: Metrics,
    telemetry: Option<Telemetry>,
    name: String,
    api: Api<GpuNode>,
    lookahead: chrono::Duration,
    publisher: Publisher,
    recorder: Recorder,
    quarantines: Quarantines,
    blocked_since: Option<std::time::Instant>,
    /// Pods asked to be evicted and not gone yet, so that each is logged and counted once.
    asked: BTreeSet<String>,
    /// The slices as the last pass left them.
    last_slices: Option<Vec<gpuslice_contract::slice::SliceConfig>>,
    /// The claims allocated on slices a pass re-cut before they were prepared (by UID), asked to
    /// be evicted until they are gone.
    stale_claims: BTreeSet<String>,
    /// Pods the watchdog found using a pool's GPU past every slice.
    strays: StrayPods,
}

/// What this pass reads of the pools besides the node's own GpuNode.
struct PoolFacts {
    /// The DRA class of each policy that names one.
    classes: BTreeMap<String, String>,
    /// The pools with fault isolation on.
    isolating: BTreeSet<String>,
    /// The I/O bandwidth per slice of each pool that limits it.
    bandwidths: BTreeMap<String, u64>,
    /// The driver each pool needs at least.
    driver_minimums: BTreeMap<String, DriverMinimum>,
}

impl PoolFacts {
    fn of(config: &Config) -> PoolFacts {
        let pools = || {
            config
                .pools
                .iter()
                .filter_map(|p| Some((p.metadata.name.clone()?, p)))
        };
        PoolFacts {
            classes: config
                .policies
                .iter()
                .filter_map(|(name, p)| Some((name.clone(), p.class?.as_str().to_string())))
                .collect(),
            isolating: pools()
                .filter(|(_, p)| p.spec.fault_isolation.as_ref().is_some_and(|f| f.enabled))
                .map(|(name, _)| name)
                .collect(),
            bandwidths: pools()
                .filter_map(|(name, p)| {
                    Some((name, crate::protections::iolimit::bandwidth_of(&p.spec)?))
                })
                .collect(),
            driver_minimums: pools()
                .filter_map(|(name, p)| Some((name, p.spec.driver.clone()?)))
                .collect(),
        }
    }
}

impl<'a> NodeLoop<'a> {
    /// Makes sure the node's GpuNode exists, and starts what runs beside the passes: the
    /// socket, the memory watchdog (its reports told to the pods) and the kubelet plugin.
    async fn start(
        client: Client,
        agent: &'a Agent,
        clock: &'a Clock,
        settings: Settings,
        metrics: Metrics,
        telemetry: Option<Telemetry>,
    ) -> Result<NodeLoop<'a>, ClusterError> {
        let name = agent.node().to_string();
        let api: Api<GpuNode> = Api::all(client.clone());
        let kube_err = |source| ClusterError::Kube {
            node: name.clone(),
            source,
        };
        // The object must exist (with an empty spec, which the operator fills) before its status.
        if api.get_opt(&name).await.map_err(kube_err)?.is_none() {
            let object = apply_body("GpuNode", &name, "spec", &serde_json::json!({}));
            api.patch(
                &name,
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(&object),
            )
            .await
            .map_err(kube_err)?;
        }
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: MANAGER.into(),
                instance: Some(name.clone()),
            },
        );
        let quarantines = Quarantines::load(agent.state())?;
        agent.serve_socket()?;
        // The watchdog's reports: counted, and told to the pods concerned.
        let (reports, mut told) = tokio::sync::mpsc::unbounded_channel();
        let counted = metrics.clone();
        agent.start_watchdog(move |report| {
            counted.count_watchdog(report);
            let _ = reports.send(report.clone());
        });
        let teller = recorder.clone();
        let strays = StrayPods::default();
        let found = strays.clone();
        tokio::spawn(async move {
            while let Some(report) = told.recv().await {
                found.take(&report);
                tell_overrun(&teller, &report).await;
            }
        });
        if let Some(paths) = settings.kubelet.clone() {
            let plugin = crate::kubelet::Plugin::new(
                client.clone(),
                &name,
                agent.state().clone(),
                paths,
                agent.caches(),
                agent.claims(),
            );
            tokio::spawn(async move {
                if let Err(e) = plugin.serve().await {
                    tracing::error!("{e}");
                }
            });
        }
        Ok(NodeLoop {
            publisher: Publisher::new(client.clone(), &name),
            lookahead: chrono::Duration::from_std(settings.recut_lookahead)
                .unwrap_or(chrono::Duration::zero()),
            client,
            agent,
            clock,
            settings,
            metrics,
            telemetry,
            name,
            api,
            recorder,
            quarantines,
            blocked_since: None,
            asked: BTreeSet::new(),
            last_slices: None,
            stale_claims: BTreeSet::new(),
            strays,
        })
    }

    /// One pass: read the GpuNode and the pools, converge, ask for evictions, isolate faults,
    /// publish the devices and report the status. Returns how long to wait for the next one.
    async fn turn(&mut self) -> Result<Duration, ClusterError> {
        let started = std::time::Instant::now();
        let current = self
            .api
            .get(&self.name)
            .await
            .map_err(|source| ClusterError::Kube {
                node: self.name.clone(),
                source,
            })?;
        let config = read_config(&self.client).await;
        let facts = PoolFacts::of(&config);
        let now = self.clock.now();
        // A layout staged for a window boundary is in force from the boundary on this node's
        // clock, before the operator writes it as the spec.
        let spec = current.spec.in_force(now);
        let (switched, next_switch) =
            (current.spec.last_switch(now), current.spec.next_switch(now));
        let quarantines = &self.quarantines;
        let mut pass = self.agent.pass(now, |inventory| {
            let (gpus, problems) = plan_spec(inventory, &spec);
            Intent {
                plan: ClusterPlan {
                    at: now,
                    pools: Vec::new(),
                    nodes: vec![NodePlan {
                        node: inventory.name.clone(),
                        gpus,
                    }],
                },
                config: Config {
                    revision: current.spec.source_revision.clone(),
                    ..config
                },
                problems,
                preemptions: current.spec.preemptions.clone(),
                gpus_out: quarantines.gpus_out(),
            }
        })?;
        self.ask_evictions(&current, &mut pass).await;
        let notices = isolate_faults(
            &self.api,
            &current,
            &pass,
            &mut self.quarantines,
            &self.settings.faults,
            &facts.isolating,
            self.clock,
        )
        .await;
        let gpu_node = ObjectReference {
            api_version: Some("gpuslice.io/v1alpha1".into()),
            kind: Some("GpuNode".into()),
            name: Some(self.name.clone()),
            uid: current.metadata.uid.clone(),
            ..ObjectReference::default()
        };
        tell_faults(&self.recorder, &gpu_node, &self.name, &notices).await;
        tell_overdue(&self.recorder, &pass, now).await;
        self.record(&pass, &facts, started);
        let (outdated, driver_supported) = driver_check(
            &pass.inventory,
            &spec.gpus,
            &facts.driver_minimums,
            current.metadata.generation,
        );
        let was_supported = current
            .status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "DriverSupported"))
            .map(|c| c.status == "True");
        if driver_supported.status == "False" && was_supported != Some(false) {
            tracing::warn!("node {}: {}", self.name, driver_supported.message);
        }
        self.close_slices(&pass, &spec.gpus, &outdated);
        let devices = self.devices(&current, &spec.gpus, &pass, &outdated);
        self.publisher.publish(devices).await;
        // After the devices, which the scheduler waits for; the status is for people and the
        // operator's counts.
        let quarantined = quarantine_condition(
            &self.quarantines.list,
            &self.name,
            current.metadata.generation,
        );
        let io_limited = io_condition(
            self.agent.io(),
            &spec.gpus,
            &facts.bandwidths,
            current.metadata.generation,
        );
        let report = status(
            &pass,
            current.metadata.generation,
            switched,
            current.status.as_ref(),
            driver_supported,
            quarantined,
            io_limited,
        );
        let report_due = self.report(&current, report, switched).await;
        // Our own status write comes back as a change too; that pass finds nothing to do.
        let mut wake = next_wake(&pass, self.clock, self.settings.interval)
            .min(until_taint(&spec.gpus, self.lookahead, self.clock))
            .min(next_switch.map_or(Duration::MAX, |at| self.clock.until(at)));
        if let Some(due) = report_due {
            wake = wake.min(self.clock.until(due).max(MIN_WAIT));
        }
        // An XID waiting for its kernel record; a GPU just taken out starts draining at once.
        if let Some(due) = self.settings.faults.next_due(std::time::Instant::now()) {
            wake = wake.min(due.max(MIN_WAIT));
        }
        if notices.iter().any(|n| matches!(n, Notice::GpuOut(_))) {
            wake = MIN_WAIT;
        }
        Ok(wake)
    }

    /// Adds to the pass's evictions the victims never prepared here and the pods whose claims
    /// were allocated on slices since re-cut; counts and logs each once.
    async fn ask_evictions(&mut self, current: &GpuNode, pass: &mut Pass) {
        pass.evictions.extend(
            unprepared_victims(&self.client, &current.spec.preemptions, &pass.claims).await,
        );
        let slices = crate::gpu::slices::configs(&pass.inventory);
        let recut = recut_devices(self.last_slices.as_deref().unwrap_or_default(), &slices);
        self.last_slices = Some(slices);
        pass.evictions.extend(
            stale_allocations(
                &self.client,
                &self.name,
                &recut,
                &pass.claims,
                &mut self.stale_claims,
            )
            .await,
        );
        pass.evictions.extend(self.strays.still_running());
        ask_evictions(&self.metrics, &pass.evictions, &mut self.asked);
    }

    /// The pass's metrics.
    fn record(&mut self, pass: &Pass, facts: &PoolFacts, started: std::time::Instant) {
        self.metrics.record_quarantines(&self.quarantines.list);
        self.metrics.record_caches(&self.agent.caches().all());
        let readings = Readings {
            state: self.agent.state(),
            telemetry: &self.agent.telemetry(),
            compute: &self.agent.compute_usage(),
            classes: &facts.classes,
        };
        self.metrics
            .record(pass, &readings, started, &mut self.blocked_since);
        if let Some(t) = &self.telemetry {
            t.pass_done();
        }
    }

    /// What DRA does not offer, `gpuslice run` is not given either: software slices of pools
    /// the driver is too old for, and quarantined slices.
    fn close_slices(
        &self,
        pass: &Pass,
        gpus: &[gpuslice_api::GpuAssignment],
        outdated: &BTreeMap<String, gpuslice_planning::driver::Shortfall>,
    ) {
        let closed = crate::gpu::slices::configs(&pass.inventory)
            .into_iter()
            .filter(|c| {
                let pool = gpus.iter().find(|a| a.index == c.gpu);
                let outdated = c.kind.shares_gpu()
                    && pool.is_some_and(|a| outdated.contains_key(&a.assigned.pool));
                outdated || !self.quarantines.taints(c.gpu, &c.id).is_empty()
            })
            .map(|c| c.id)
            .collect();
        self.agent.close_slices(closed);
    }

    /// The DRA devices of the slices in force, with their taints: re-cut ahead or waiting,
    /// compacting, quarantined, held by a `gpuslice run`.
    fn devices(
        &self,
        current: &GpuNode,
        gpus: &[gpuslice_api::GpuAssignment],
        pass: &Pass,
        outdated: &BTreeMap<String, gpuslice_planning::driver::Shortfall>,
    ) -> Vec<Device> {
        let now = self.clock.now();
        // A GPU whose new layout waits for busy slices is about to be re-cut as well.
        let waiting: Vec<u32> = pass
            .outcomes
            .iter()
            .filter(|o| !o.blocked_by.is_empty())
            .map(|o| o.index)
            .collect();
        // Slices `gpuslice run` commands hold: one holder per slice, so no pod goes there.
        let held_locally: BTreeMap<&str, u32> = pass
            .claims
            .iter()
            .filter(|c| c.resource_claim.is_none())
            .map(|c| (c.slice.as_str(), c.client))
            .collect();
        dra::devices(&pass.inventory, gpus, &|a, slice| {
            // Old drivers break the shim's isolation; MIG's is the hardware's.
            if slice.kind.shares_gpu() && outdated.contains_key(&a.assigned.pool) {
                return None;
            }
            let recut = if waiting.contains(&a.index) {
                Some(dra::pending_recut_taint())
            } else {
                dra::recut_taint(
                    a.recut_at.as_ref().and_then(gpuslice_api::chrono_of),
                    self.lookahead,
                    now,
                )
            };
            let mut taints: Vec<_> = recut.into_iter().collect();
            if current.spec.compacting.contains(&a.index) {
                taints.push(dra::compacting_taint());
            }
            taints.extend(self.quarantines.taints(a.index, &slice.id));
            if let Some(pid) = held_locally.get(slice.id.as_str()) {
                taints.push(dra::held_locally_taint(*pid));
            }
            Some(taints)
        })
    }

    /// Writes the status when it changed, except one that only says a staged switch happened,
    /// which waits for the operator's catch-up write (see [`SWITCH_REPORT_AFTER`]). Returns when
    /// such a held-back report is due.
    async fn report(
        &self,
        current: &GpuNode,
        report: gpuslice_api::GpuNodeStatus,
        switched: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Option<chrono::DateTime<chrono::Utc>> {
        let report_due = switched.map(|at| at + SWITCH_REPORT_AFTER);
        let only_switched = current.status.as_ref().is_some_and(|old| {
            old.conditions == report.conditions
                && old.claims == report.claims
                && old.applied_generation == report.applied_generation
        });
        let wait_for_catch_up =
            only_switched && report_due.is_some_and(|due| due > self.clock.now());
        if current.status.as_ref() != Some(&report) && !wait_for_catch_up {
            let name = &self.name;
            let patch = apply_body("GpuNode", name, "status", &report);
            let params = PatchParams::apply(MANAGER).force();
            if let Err(e) = self
                .api
                .patch_status(name, &params, &Patch::Apply(&patch))
                .await
            {
                tracing::warn!("GpuNode/{name}: reporting status: {e}");
            }
        }
        report_due.filter(|_| wait_for_catch_up)
    }
}

/// Until the next re-cut taint is due (never, when none is ahead).
fn until_taint(
    gpus: &[gpuslice_api::GpuAssignment],
    lookahead: chrono::Duration,
    clock: &Clock,
) -> Duration {
    let now = clock.now();
    gpus.iter()
        .filter_map(|a| a.recut_at.as_ref().and_then(gpuslice_api::chrono_of))
        .map(|at| at - lookahead)
        .filter(|due| *due > now)
        .map(|due| clock.until(due))
        .min()
        .unwrap_or(Duration::MAX)
}

/// The interval, or (while blocked) the next retry or grace deadline.
fn next_wake(pass: &Pass, clock: &Clock, interval: Duration) -> Duration {
    let mut wake = interval;
    if pass.blocked() || !pass.draining.is_empty() {
        wake = wake.min(BLOCKED_RETRY);
        for until in pass.draining.iter().filter_map(|w| w.until) {
            wake = wake.min(clock.until(until));
        }
    }
    wake.max(MIN_WAIT)
}
