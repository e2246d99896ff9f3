//! Whole-repository checks on typed objects: what only a view of every object at once can tell
//! (references, unique names, fits against the GPU catalog, overlapping windows). The schema
//! and CEL checks of single objects live in `gpuslice_api::admission`.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use gpuslice_api::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use gpuslice_api::{CheckpointPolicy, GpuPool, GpuSlicePolicy, Kind};
use serde::Serialize;

mod policy;
mod pool;
use policy::{check_checkpoint_storage, check_policy};
use pool::check_pool;

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
