//! Whole-repository checks on typed objects: what only a view of every object at once can tell
//! (references, unique names, fits against the GPU catalog, overlapping windows). The schema
//! and CEL checks of single objects live in `gpuslice_api::admission`.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use gpuslice_api::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use gpuslice_api::pool::Elastic;
use gpuslice_api::quantity::format_bytes;
use gpuslice_api::{CheckpointPolicy, GpuPool, GpuSlicePolicy, Kind, Layout, LayoutKind};
use serde::Serialize;

use crate::catalog::{self, GpuModel};
use crate::windows::{Recurrence, first_overlap};
use crate::{elastic, mig};

/// How bad a finding is: errors fail `gpuslice validate`, warnings do not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

/// A problem with one field of one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// The document the object came from (an index the caller chose).
    pub doc: usize,
    pub severity: Severity,
    /// Dotted field path, for example `spec.layout.software.memory`.
    pub path: String,
    pub message: String,
}

/// An object with the document it came from and a printable location of that document.
#[derive(Clone, Debug)]
pub struct Located<T> {
    pub doc: usize,
    pub origin: String,
    pub object: T,
}

/// A workload (Job, Deployment, …) that names a policy.
#[derive(Clone, Debug)]
pub struct WorkloadRef {
    pub doc: usize,
    /// `Kind/namespace/name` as shown to the user.
    pub display: String,
    pub policy: String,
    /// Where the reference is (the label, or the annotation used by mistake).
    pub path: String,
    /// True when the policy is named by an annotation instead of the label.
    pub via_annotation: bool,
    /// Its containers that may run as root (`runAsNonRoot` not true), as field paths.
    pub root_containers: Vec<String>,
    /// The namespace its pods are created in.
    pub namespace: String,
    /// Where its pod template declares a volume named [`gpuslice_api::CHECKPOINT_VOLUME`].
    pub checkpoint_volume: Option<String>,
}

/// Everything a repository declares, typed.
#[derive(Clone, Debug, Default)]
pub struct Repo {
    pub pools: Vec<Located<GpuPool>>,
    pub policies: Vec<Located<GpuSlicePolicy>>,
    pub checkpoints: Vec<Located<CheckpointPolicy>>,
    /// Names of other objects of our kinds (GpuNode), for the uniqueness check.
    pub others: Vec<Located<(Kind, String)>>,
    pub workloads: Vec<WorkloadRef>,
    /// The PersistentVolumeClaims it declares, as (namespace, name).
    pub volume_claims: Vec<(String, String)>,
}

/// Runs every whole-repository check. `now` anchors the search for overlapping windows.
pub fn check(repo: &Repo, now: DateTime<Utc>) -> Vec<Finding> {
    let mut out = Findings::default();
    unique_names(repo, &mut out);
    let checkpoints: BTreeMap<&str, &CheckpointPolicy> = repo
        .checkpoints
        .iter()
        .map(|c| (name_of(&c.object.metadata), &c.object))
        .collect();
    let pools: BTreeMap<&str, &Located<GpuPool>> = repo
        .pools
        .iter()
        .map(|p| (name_of(&p.object.metadata), p))
        .collect();
    for pool in &repo.pools {
        check_pool(pool, &checkpoints, now, &mut out);
    }
    for policy in &repo.policies {
        check_policy(policy, &pools, &checkpoints, &mut out);
    }
    let policies: BTreeMap<&str, _> = repo
        .policies
        .iter()
        .map(|p| (name_of(&p.object.metadata), p))
        .collect();
    inert_fields(repo, &mut out);
    for w in &repo.workloads {
        if w.via_annotation {
            out.warn(w.doc, &w.path, format!(
                "{} names its policy in an annotation; use the label {} on the pod template (spec.template.metadata.labels): the chart's MutatingAdmissionPolicy selects on labels",
                w.display,
                gpuslice_api::POLICY_LABEL
            ));
        }
        let pool = policies
            .get(w.policy.as_str())
            .and_then(|p| pools.get(p.object.spec.pool.as_str()));
        if let Some(pool) = pool.filter(|p| p.object.spec.require_non_root)
            && !w.root_containers.is_empty()
        {
            out.error(
                w.doc,
                &w.path,
                format!(
                    "{} uses GpuSlicePolicy {:?} of pool {}, which requires non-root workloads (spec.requireNonRoot): admission would refuse its pods; set securityContext.runAsNonRoot: true in the pod template, or in {}",
                    w.display,
                    w.policy,
                    name_of(&pool.object.metadata),
                    w.root_containers.join(", ")
                ),
            );
        }
        if let Some(policy) = policies.get(w.policy.as_str()) {
            check_checkpoint_storage(repo, w, &policy.object, &checkpoints, &mut out);
        }
        if !policies.contains_key(w.policy.as_str()) {
            out.error(
                w.doc,
                &w.path,
                format!(
                    "{} uses GpuSlicePolicy {:?}, which this repository does not define",
                    w.display, w.policy
                ),
            );
        }
    }
    out.0
}

/// A workload whose policy's CheckpointPolicy (its own, else its pool's) mounts storage: it may
/// not declare the volume admission adds, and the claim should exist in its namespace.
fn check_checkpoint_storage(
    repo: &Repo,
    w: &WorkloadRef,
    policy: &GpuSlicePolicy,
    checkpoints: &BTreeMap<&str, &CheckpointPolicy>,
    out: &mut Findings,
) {
    let pools = repo.pools.iter().map(|p| &p.object);
    let Some(name) = policy.spec.checkpoint_policy_in(pools) else {
        return;
    };
    let Some(claim) = checkpoints
        .get(name)
        .and_then(|c| c.spec.storage.as_ref()?.persistent_volume_claim.as_ref())
    else {
        return;
    };
    if let Some(path) = &w.checkpoint_volume {
        out.error(
            w.doc,
            path,
            format!(
                "{} declares the volume {} itself: admission adds it from CheckpointPolicy {name:?}'s storage (claim {claim:?}), and the API server would refuse pods with both; remove it (the claim is mounted at spec.storage.mountPath, told as GPUSLICE_CHECKPOINT_DIR)",
                w.display,
                gpuslice_api::CHECKPOINT_VOLUME
            ),
        );
    }
    let declared = repo
        .volume_claims
        .iter()
        .any(|(ns, c)| *ns == w.namespace && c == claim);
    if !declared {
        out.warn(
            w.doc,
            &w.path,
            format!(
                "{}'s pods get PersistentVolumeClaim {claim:?} of namespace {} (CheckpointPolicy {name:?}'s storage), which this repository does not declare: create it there (here or in the cluster), or the queue holds the pods (reason CheckpointStorageMissing)",
                w.display, w.namespace
            ),
        );
    }
}

/// The client processes an MPS server serves on one GPU (Volta and newer, NVIDIA's MPS docs).
const MPS_CLIENTS: u32 = 48;

/// A policy's `count` and `topology` against its pool: several software slices cannot be capped
/// in one container, and a topology constrains only several slices.
fn check_count(
    doc: usize,
    spec: &gpuslice_api::GpuSlicePolicySpec,
    pool: &GpuPool,
    out: &mut Findings,
) {
    if spec.count > 1 {
        let software: Vec<String> = layouts(pool)
            .into_iter()
            .filter(|(_, _, layout)| layout.software.is_some() || layout.mps.is_some())
            .map(|(_, what, _)| what)
            .collect();
        if !software.is_empty() {
            out.error(
                doc,
                "spec.count",
                format!(
                    "count {} on pool {:?}, which gives software slices in {}: a container is capped to one software slice, so its pods would never start; set count to 1, or use a pool of whole GPUs (exclusive) or MIG instances",
                    spec.count,
                    spec.pool,
                    software.join(" and ")
                ),
            );
        }
    } else if spec.topology.is_some() {
        out.warn(
            doc,
            "spec.topology",
            "it constrains where a pod's slices are relative to each other, and with count 1 there is one: it has no effect; remove it, or raise count".to_string(),
        );
    }
}

/// What a warning about a field no code acts on yet says; each goes away in the change that
/// makes its field work.
pub const NOT_ENFORCED: &str = "declared but not enforced yet";

/// Warns about every field that is accepted but has no effect yet, so nobody relies on it.
fn inert_fields(repo: &Repo, out: &mut Findings) {
    for checkpoint in &repo.checkpoints {
        let spec = &checkpoint.object.spec;
        let mut warn = |path: &str, what: &str| out.inert(checkpoint.doc, path, what);
        if spec
            .storage
            .as_ref()
            .is_some_and(|s| s.persistent_volume_claim.is_none())
        {
            warn(
                "spec.storage",
                "without persistentVolumeClaim nothing is mounted at mountPath: name a claim, or mount a volume there in the pod",
            );
        }
    }
}

#[derive(Default)]
struct Findings(Vec<Finding>);

impl Findings {
    fn push(&mut self, doc: usize, severity: Severity, path: &str, message: String) {
        self.0.push(Finding {
            doc,
            severity,
            path: path.to_string(),
            message,
        });
    }
    fn error(&mut self, doc: usize, path: &str, message: String) {
        self.push(doc, Severity::Error, path, message);
    }
    /// A field accepted but not acted on yet.
    fn inert(&mut self, doc: usize, path: &str, what: &str) {
        self.warn(
            doc,
            path,
            format!("{NOT_ENFORCED}: {what}; it has no effect today"),
        );
    }
    fn warn(&mut self, doc: usize, path: &str, message: String) {
        self.push(doc, Severity::Warning, path, message);
    }
}

fn name_of(meta: &ObjectMeta) -> &str {
    meta.name.as_deref().unwrap_or("")
}

fn unique_names(repo: &Repo, out: &mut Findings) {
    let mut seen: BTreeMap<(Kind, &str), &str> = BTreeMap::new();
    let all = repo
        .pools
        .iter()
        .map(|p| (p.doc, &p.origin, Kind::GpuPool, name_of(&p.object.metadata)))
        .chain(repo.policies.iter().map(|p| {
            (
                p.doc,
                &p.origin,
                Kind::GpuSlicePolicy,
                name_of(&p.object.metadata),
            )
        }))
        .chain(repo.checkpoints.iter().map(|p| {
            (
                p.doc,
                &p.origin,
                Kind::CheckpointPolicy,
                name_of(&p.object.metadata),
            )
        }))
        .chain(
            repo.others
                .iter()
                .map(|o| (o.doc, &o.origin, o.object.0, o.object.1.as_str())),
        );
    for (doc, origin, kind, name) in all {
        if let Some(first) = seen.get(&(kind, name)) {
            out.error(doc, "metadata.name", format!("{kind} {name:?} is already defined at {first}; names of one kind must be unique"));
        } else {
            seen.insert((kind, name), origin);
        }
    }
}

/// The pool's layouts with their field paths and display names.
fn layouts(pool: &GpuPool) -> Vec<(String, String, &Layout)> {
    let mut out = vec![(
        "spec.layout".to_string(),
        "the default layout".to_string(),
        &pool.spec.layout,
    )];
    for (i, w) in pool.spec.windows.iter().enumerate() {
        out.push((
            format!("spec.windows[{i}].layout"),
            format!("window {:?}", w.name),
            &w.layout,
        ));
    }
    out
}

/// The pool's elastic sets (its own and its windows') with their field paths.
fn elastic_sets(pool: &GpuPool) -> Vec<(String, &Elastic)> {
    let windows = pool.spec.windows.iter().enumerate();
    pool.spec
        .elastic
        .iter()
        .map(|e| ("spec.elastic".to_string(), e))
        .chain(windows.filter_map(|(i, w)| {
            let set = w.elastic.as_ref()?;
            Some((format!("spec.windows[{i}].elastic"), set))
        }))
        .collect()
}

/// The models an elastic shape is tried on: those selected, or every model in the catalog.
fn elastic_candidates(pool: &GpuPool) -> (Vec<&'static GpuModel>, bool) {
    let named = selected_models(pool).known;
    if named.is_empty() {
        (catalog::models().iter().collect(), false)
    } else {
        (named, true)
    }
}

/// Each shape of each elastic set must fit a GPU of the pool.
fn check_elastic(pool: &Located<GpuPool>, out: &mut Findings) {
    let (candidates, named) = elastic_candidates(&pool.object);
    for (path, set) in elastic_sets(&pool.object) {
        for (k, shape) in set.shapes.iter().enumerate() {
            let held: Vec<&str> = candidates
                .iter()
                .filter(|m| {
                    elastic::slots(&shape.layout, Some(m), m.name, m.memory_bytes()).is_some()
                })
                .map(|m| m.name)
                .collect();
            let at = format!("{path}.shapes[{k}].layout");
            let tried: Vec<&str> = candidates.iter().map(|m| m.name).collect();
            if held.is_empty() {
                out.error(pool.doc, &at, format!(
                    "elastic shape {:?} fits no GPU of the pool ({}): its slices do not fit the GPU's memory or its MIG profiles do not exist there; change the layout or remove the shape",
                    shape.name,
                    if named { tried.join(", ") } else { "no model in the catalog".to_string() }
                ));
            } else if named && held.len() < candidates.len() {
                out.warn(
                    pool.doc,
                    &at,
                    format!(
                        "elastic shape {:?} fits only {}: the pool's other GPUs never take it",
                        shape.name,
                        held.join(", ")
                    ),
                );
            }
        }
    }
}

/// The names of the elastic shapes of `pool` that hold `need` bytes at `compute` percent on
/// some GPU of the pool, and the names of all its shapes.
fn elastic_fits(pool: &GpuPool, need: u64, compute: u32) -> (Vec<String>, Vec<String>) {
    let (candidates, _) = elastic_candidates(pool);
    let mut fits = Vec::new();
    let mut all = Vec::new();
    for (_, set) in elastic_sets(pool) {
        for shape in &set.shapes {
            all.push(shape.name.clone());
            let holds = candidates.iter().any(|m| {
                elastic::slots(&shape.layout, Some(m), m.name, m.memory_bytes())
                    .is_some_and(|slots| slots.iter().any(|s| s.holds(need, compute)))
            });
            if holds {
                fits.push(shape.name.clone());
            }
        }
    }
    (fits, all)
}

/// The GPU models a pool's selector names: those in the catalog, and (by index) those not.
struct SelectedModels {
    known: Vec<&'static GpuModel>,
    unknown: Vec<(usize, String)>,
}

fn selected_models(pool: &GpuPool) -> SelectedModels {
    let mut selected = SelectedModels {
        known: Vec::new(),
        unknown: Vec::new(),
    };
    for (i, name) in pool
        .spec
        .gpu_selector
        .iter()
        .flat_map(|s| s.models.iter())
        .enumerate()
    {
        match catalog::model(name) {
            Ok(m) => selected.known.push(m),
            Err(_) => selected.unknown.push((i, name.clone())),
        }
    }
    selected
}

/// The models a MIG layout must fit: those selected, or every MIG model when none is named.
fn mig_candidates(models: &[&'static GpuModel]) -> Vec<&'static GpuModel> {
    if models.is_empty() {
        catalog::models()
            .iter()
            .filter(|m| m.mig.is_some())
            .collect()
    } else {
        models.to_vec()
    }
}

fn check_pool(
    pool: &Located<GpuPool>,
    checkpoints: &BTreeMap<&str, &CheckpointPolicy>,
    now: DateTime<Utc>,
    out: &mut Findings,
) {
    let doc = pool.doc;
    let spec = &pool.object.spec;
    let SelectedModels {
        known: models,
        unknown,
    } = selected_models(&pool.object);
    let any_mig = layouts(&pool.object)
        .iter()
        .any(|(_, _, l)| l.mig.is_some());
    let any_mps = layouts(&pool.object)
        .iter()
        .any(|(_, _, l)| l.mps.is_some());
    for (i, name) in &unknown {
        let path = format!("spec.gpuSelector.models[{i}]");
        if any_mig {
            out.error(doc, &path, format!("{name:?} is not a MIG-capable model in the catalog, but the pool uses a MIG layout; use one of: {}", mig_model_names()));
        } else {
            out.warn(doc, &path, format!("{name:?} is not in the GPU catalog: memory checks are skipped (fine for GPUs without MIG; check the spelling against nvidia-smi --query-gpu=name)"));
        }
        if any_mps {
            out.warn(doc, &path, format!("{name:?} is not in the GPU catalog, and the pool uses an mps layout: MPS compute shares need a Volta or newer GPU (compute capability 7.0); the agent refuses the layout on an older one"));
        }
    }
    let headroom = pool.object.spec.headroom_bytes();
    for (path, what, layout) in layouts(&pool.object) {
        match layout.kind() {
            Some(kind @ (LayoutKind::Software(s) | LayoutKind::Mps(s))) => {
                let field = if matches!(kind, LayoutKind::Mps(_)) {
                    "mps"
                } else {
                    "software"
                };
                if field == "mps" && s.slices > MPS_CLIENTS {
                    out.warn(doc, &format!("{path}.mps.slices"), format!(
                        "{} MPS slices: an MPS server serves at most {MPS_CLIENTS} client processes per GPU (Volta and newer), so some workloads would wait for a place; use at most {MPS_CLIENTS} slices",
                        s.slices
                    ));
                }
                let Ok(memory) = s.memory.bytes() else {
                    continue;
                };
                if memory <= headroom {
                    out.error(doc, &format!("{path}.{field}.memory"), format!(
                        "slice memory {} leaves nothing once memoryHeadroom {} is kept back; raise memory or lower memoryHeadroom",
                        format_bytes(memory), format_bytes(headroom)
                    ));
                }
                for m in &models {
                    let total = memory.saturating_mul(u64::from(s.slices));
                    if total > m.memory_bytes() {
                        out.error(doc, &format!("{path}.{field}"), format!(
                            "{} slices × {} = {} exceed the {} of a {}; use fewer or smaller slices",
                            s.slices, format_bytes(memory), format_bytes(total), format_bytes(m.memory_bytes()), m.name
                        ));
                    }
                }
            }
            Some(LayoutKind::Mig(layout)) => {
                let candidates = mig_candidates(&models);
                let results: Vec<_> = candidates
                    .iter()
                    .map(|m| (m, mig::solve(m, layout)))
                    .collect();
                if models.is_empty() {
                    // No model named: the layout must work on at least one MIG model.
                    if results.iter().all(|(_, r)| r.is_err()) {
                        let why = results
                            .iter()
                            .filter_map(|(_, r)| r.as_ref().err())
                            .find(|e| !matches!(e, mig::MigError::UnknownProfile { .. }));
                        let message = match why {
                            Some(e) => format!("{what} fits no MIG-capable GPU: {e}"),
                            None => format!(
                                "{what} names profiles no GPU model has together; set gpuSelector.models and use that model's profile names"
                            ),
                        };
                        out.error(doc, &format!("{path}.mig"), message);
                    }
                } else {
                    for (m, r) in results {
                        if let Err(e) = r {
                            out.error(
                                doc,
                                &format!("{path}.mig"),
                                format!("{what} does not fit a {}: {e}", m.name),
                            );
                        }
                    }
                }
            }
            Some(LayoutKind::Exclusive) | None => {}
        }
    }
    check_windows(pool, now, out);
    check_elastic(pool, out);
    check_checkpoint_reference(doc, spec.checkpoint_policy.as_deref(), checkpoints, out);
    if let Some(Err(e)) = spec
        .compaction
        .as_ref()
        .and_then(|c| c.window.as_ref())
        .map(Recurrence::of_daily)
    {
        let path = match e {
            crate::windows::WindowError::UnknownTimeZone(_) => "spec.compaction.window.timeZone",
            _ => "spec.compaction.window",
        };
        out.error(doc, path, e.to_string());
    }
}

fn check_checkpoint_reference(
    doc: usize,
    name: Option<&str>,
    checkpoints: &BTreeMap<&str, &CheckpointPolicy>,
    out: &mut Findings,
) {
    if let Some(name) = name
        && !checkpoints.contains_key(name)
    {
        out.error(
            doc,
            "spec.checkpointPolicy",
            format!("CheckpointPolicy {name:?} is not defined in this repository"),
        );
    }
}

fn mig_model_names() -> String {
    catalog::models()
        .iter()
        .filter(|m| m.mig.is_some())
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

fn check_windows(pool: &Located<GpuPool>, now: DateTime<Utc>, out: &mut Findings) {
    let windows = &pool.object.spec.windows;
    let mut parsed = Vec::new();
    for (i, w) in windows.iter().enumerate() {
        match Recurrence::of_window(w) {
            Ok(r) => parsed.push((i, r)),
            Err(e @ crate::windows::WindowError::UnknownTimeZone(_)) => out.error(
                pool.doc,
                &format!("spec.windows[{i}].timeZone"),
                e.to_string(),
            ),
            Err(e) => out.error(pool.doc, &format!("spec.windows[{i}]"), e.to_string()),
        }
    }
    for (a, (i, ra)) in parsed.iter().enumerate() {
        for (j, rb) in parsed.iter().skip(a + 1) {
            // A year covers every weekday and both daylight-saving changes.
            if let Some(at) = first_overlap(ra, rb, now, 371) {
                out.error(pool.doc, &format!("spec.windows[{j}]"), format!(
                    "window {:?} overlaps window {:?} (both open at {}); windows of one pool must not overlap",
                    windows[*j].name, windows[*i].name, at.format("%a %Y-%m-%d %H:%M UTC")
                ));
            }
        }
    }
}

fn check_policy(
    policy: &Located<GpuSlicePolicy>,
    pools: &BTreeMap<&str, &Located<GpuPool>>,
    checkpoints: &BTreeMap<&str, &CheckpointPolicy>,
    out: &mut Findings,
) {
    let doc = policy.doc;
    let spec = &policy.object.spec;
    check_checkpoint_reference(doc, spec.checkpoint_policy.as_deref(), checkpoints, out);
    check_host(doc, spec.host.as_ref(), out);
    let Some(pool) = pools.get(spec.pool.as_str()) else {
        out.error(
            doc,
            "spec.pool",
            format!("GpuPool {:?} is not defined in this repository", spec.pool),
        );
        return;
    };
    check_count(doc, spec, &pool.object, out);
    let Ok(memory) = spec.memory.bytes() else {
        return;
    };
    let headroom = pool.object.spec.headroom_bytes();
    let demand = Demand {
        memory,
        headroom,
        need: memory.saturating_add(headroom),
        limit: spec.compute.as_ref().map(|c| c.limit),
    };
    let (need, limit) = (demand.need, demand.limit);
    let models = selected_models(&pool.object).known;
    let mut fits = Vec::new();
    let mut misfits = Vec::new();
    for (_, what, layout) in layouts(&pool.object) {
        let why_not = why_not_fits(layout, &what, &models, &demand);
        match why_not {
            None => fits.push(what),
            Some(reason) => misfits.push((what, reason)),
        }
    }
    let (elastic_fit, shapes) = elastic_fits(&pool.object, need, limit.unwrap_or(0));
    if !shapes.is_empty() && elastic_fit.is_empty() {
        out.error(
            doc,
            "spec.memory",
            format!(
                "no shape of pool {:?}'s elastic set ({}) holds {} (memory + memoryHeadroom){}: add a shape with a larger slice or lower the policy's memory",
                spec.pool,
                shapes.join(", "),
                format_bytes(need),
                limit.map(|l| format!(" at a {l}% compute limit")).unwrap_or_default()
            ),
        );
    }
    if fits.is_empty() && elastic_fit.is_empty() {
        for (_, (path, message)) in misfits {
            out.error(
                doc,
                path,
                format!("no slice of pool {:?} fits: {message}", spec.pool),
            );
        }
    } else {
        for (what, (path, message)) in misfits {
            let text = if elastic_fit.is_empty() {
                format!(
                    "cannot run during {what} of pool {:?}: {message}",
                    spec.pool
                )
            } else {
                format!(
                    "{what} of pool {:?} does not hold it ({message}); it runs once the elastic set re-cuts a GPU to {}",
                    spec.pool,
                    elastic_fit.join(" or ")
                )
            };
            out.warn(doc, path, text);
        }
    }
}

/// What a policy asks of a slice: its memory, the pool's headroom, both together, and its
/// compute limit.
struct Demand {
    memory: u64,
    headroom: u64,
    need: u64,
    limit: Option<u32>,
}

/// Why no slice of `layout` (`what` names it; `models` are the pool's GPUs) holds `demand`:
/// the field to change and the reason, or `None` where it fits.
fn why_not_fits(
    layout: &Layout,
    what: &str,
    models: &[&'static GpuModel],
    demand: &Demand,
) -> Option<(&'static str, String)> {
    let Demand {
        memory,
        headroom,
        need,
        limit,
    } = *demand;
    match layout.kind() {
        Some(LayoutKind::Software(s) | LayoutKind::Mps(s)) => {
            let slice = s.memory.bytes().unwrap_or(0);
            if need > slice {
                Some((
                    "spec.memory",
                    format!(
                        "{} + memoryHeadroom {} = {} does not fit the {} slices of {what}",
                        format_bytes(memory),
                        format_bytes(headroom),
                        format_bytes(need),
                        format_bytes(slice)
                    ),
                ))
            } else {
                limit.filter(|&l| l > s.compute).map(|limit| {
                    (
                        "spec.compute.limit",
                        format!(
                            "compute limit {limit}% exceeds the {}% share of each slice of {what} (guarantees on one GPU could then add up to more than 100%)",
                            s.compute
                        ),
                    )
                })
            }
        }
        Some(LayoutKind::Mig(m)) => {
            let candidates = mig_candidates(models);
            let largest = candidates
                .iter()
                .filter_map(|model| {
                    let counts = mig::requested_profiles(model, m).ok()?;
                    counts
                        .keys()
                        .filter_map(|p| model.profile(p))
                        .map(|p| p.memory_bytes())
                        .max()
                })
                .max();
            match largest {
                Some(largest) if need > largest => Some((
                    "spec.memory",
                    format!(
                        "{} + memoryHeadroom {} = {} does not fit the largest MIG instance of {what} ({})",
                        format_bytes(memory),
                        format_bytes(headroom),
                        format_bytes(need),
                        format_bytes(largest)
                    ),
                )),
                _ => None,
            }
        }
        Some(LayoutKind::Exclusive) => models
            .iter()
            .map(|m| m.memory_bytes())
            .min()
            .filter(|&gpu| need > gpu)
            .map(|gpu| {
                (
                    "spec.memory",
                    format!(
                        "{} + memoryHeadroom exceeds a whole GPU ({}) in {what}",
                        format_bytes(memory),
                        format_bytes(gpu)
                    ),
                )
            }),
        None => None,
    }
}

/// A policy's host limits (`spec.host`): the CPU and memory quantities parse.
fn check_host(doc: usize, host: Option<&gpuslice_api::HostResources>, out: &mut Findings) {
    let Some(host) = host else {
        return;
    };
    if let Some(cpu) = &host.cpu
        && let Err(e) = gpuslice_api::millicores_of(&cpu.0)
    {
        out.error(doc, "spec.host.cpu", e.to_string());
    }
    if let Some(memory) = &host.memory
        && let Err(e) = memory.bytes()
    {
        out.error(doc, "spec.host.memory", e.to_string());
    }
}
