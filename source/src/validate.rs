//! `gpuslice validate`: every problem of a GitOps repository, each as
//! `file:line: Kind/name: field.path: reason`.
//!
//! Pipeline per document: YAML → schema and CEL (what the API server checks) → typed parse →
//! whole-repository checks (references, unique names, catalog fits, window overlaps).

use std::fmt;

use crate::{Document, SourceFile};
use chrono::{DateTime, Utc};
use gpuslice_api::{
    CheckpointPolicy, GpuNode, GpuPool, GpuSlicePolicy, Kind, POLICY_LABEL, admission,
};
use gpuslice_planning::validate::{self as repo_checks, Located, Repo, Severity, WorkloadRef};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// One problem, located.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Problem {
    pub file: String,
    pub line: usize,
    pub column: usize,
    pub severity: Severity,
    /// `Kind/name` of the object, when the problem belongs to one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub object: Option<String>,
    /// Dotted field path; empty for file-level problems.
    pub path: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: ", self.file, self.line)?;
        if let Some(object) = &self.object {
            write!(f, "{object}: ")?;
        }
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        if self.severity == Severity::Warning {
            write!(f, "warning: ")?;
        }
        f.write_str(&self.message)
    }
}

/// The outcome of validating a set of files.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub files: usize,
    /// Objects of our kinds read.
    pub objects: usize,
    /// Workloads that name a policy.
    pub workloads: usize,
    pub errors: usize,
    pub warnings: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    pub problems: Vec<Problem>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.errors == 0
    }

    /// A one-line summary for people.
    pub fn summary(&self) -> String {
        let verdict = if self.ok() { "ok" } else { "FAILED" };
        format!(
            "{verdict}: {} error{}, {} warning{} in {} file{} ({} gpuslice object{}, {} workload{} using a policy)",
            self.errors,
            plural(self.errors),
            self.warnings,
            plural(self.warnings),
            self.files,
            plural(self.files),
            self.objects,
            plural(self.objects),
            self.workloads,
            plural(self.workloads)
        )
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// Where each document came from.
struct DocRef<'a> {
    file: &'a str,
    doc: &'a Document,
    object: Option<String>,
}

/// Validates files as one repository. `now` anchors the window-overlap search.
pub fn validate_files(files: &[SourceFile], now: DateTime<Utc>) -> Report {
    read_repository(files, now).0
}

/// Validates files as one repository and returns its valid objects too.
pub fn read_repository(files: &[SourceFile], now: DateTime<Utc>) -> (Report, Repo) {
    let parsed: Vec<_> = files
        .iter()
        .map(|f| (f.path.as_str(), crate::parse(&f.text)))
        .collect();
    let mut report = Report {
        files: files.len(),
        ..Report::default()
    };
    let mut docs: Vec<DocRef> = Vec::new();
    let mut repo = Repo::default();
    for (file, parsed) in &parsed {
        for doc in &parsed.documents {
            read_document(file, doc, &mut docs, &mut repo, &mut report);
        }
        if let Some(e) = &parsed.syntax_error {
            report.problems.push(Problem {
                file: file.to_string(),
                line: e.position.line,
                column: e.position.column,
                severity: Severity::Error,
                object: None,
                path: String::new(),
                message: format!(
                    "YAML syntax error at column {}: {}",
                    e.position.column, e.message
                ),
            });
        }
    }
    report.workloads = repo.workloads.len();
    for finding in repo_checks::check(&repo, now) {
        let d = &docs[finding.doc];
        push(
            &mut report,
            d,
            &finding.path,
            finding.severity,
            finding.message,
        );
    }
    report.problems.sort_by(|a, b| {
        (&a.file, a.line, a.column, &a.path).cmp(&(&b.file, b.line, b.column, &b.path))
    });
    report.problems.dedup();
    report.errors = report
        .problems
        .iter()
        .filter(|p| p.severity == Severity::Error)
        .count();
    report.warnings = report.problems.len() - report.errors;
    (report, repo)
}

fn push(report: &mut Report, d: &DocRef, path: &str, severity: Severity, message: String) {
    let pos = d.doc.position_of(path);
    report.problems.push(Problem {
        file: d.file.to_string(),
        line: pos.line,
        column: pos.column,
        severity,
        object: d.object.clone(),
        path: path.to_string(),
        message,
    });
}

fn str_at<'v>(value: &'v Value, pointer: &str) -> Option<&'v str> {
    value.pointer(pointer).and_then(Value::as_str)
}

fn read_document<'a>(
    file: &'a str,
    doc: &'a Document,
    docs: &mut Vec<DocRef<'a>>,
    repo: &mut Repo,
    report: &mut Report,
) {
    let value = &doc.value;
    let api_version = str_at(value, "/apiVersion").unwrap_or_default();
    let kind = str_at(value, "/kind").unwrap_or_default();
    let name = str_at(value, "/metadata/name").unwrap_or("<unnamed>");
    let index = docs.len();
    docs.push(DocRef {
        file,
        doc,
        object: (!kind.is_empty()).then(|| format!("{kind}/{name}")),
    });
    let d = &docs[index];
    let Some((group, version)) = api_version.split_once('/') else {
        if kind == "PersistentVolumeClaim" {
            let namespace = str_at(value, "/metadata/namespace").unwrap_or("default");
            repo.volume_claims
                .push((namespace.to_string(), name.to_string()));
        }
        read_workload(index, d, kind, repo);
        return;
    };
    if group != gpuslice_api::GROUP {
        read_workload(index, d, kind, repo);
        return;
    }
    let Some(our_kind) = Kind::from_kind(kind) else {
        let known: Vec<_> = Kind::ALL.iter().map(|k| k.as_str()).collect();
        push(
            report,
            d,
            "kind",
            Severity::Error,
            format!(
                "{kind:?} is not a kind of {}; use one of {}",
                gpuslice_api::GROUP,
                known.join(", ")
            ),
        );
        return;
    };
    report.objects += 1;
    if version != gpuslice_api::VERSION {
        push(
            report,
            d,
            "apiVersion",
            Severity::Error,
            format!(
                "{api_version} is not served; use {}",
                gpuslice_api::API_VERSION
            ),
        );
        return;
    }
    let errors = admission::check(our_kind, value);
    if !errors.is_empty() {
        for e in errors {
            push(report, d, &e.path, Severity::Error, e.message);
        }
        return;
    }
    let origin = format!("{file}:{}", doc.start.line);
    let at = |origin: &str| (index, origin.to_string());
    let typed = match our_kind {
        Kind::GpuPool => typed::<GpuPool>(value).map(|o| repo.pools.push(located(at(&origin), o))),
        Kind::GpuSlicePolicy => {
            typed::<GpuSlicePolicy>(value).map(|o| repo.policies.push(located(at(&origin), o)))
        }
        Kind::CheckpointPolicy => {
            typed::<CheckpointPolicy>(value).map(|o| repo.checkpoints.push(located(at(&origin), o)))
        }
        Kind::GpuNode => typed::<GpuNode>(value).map(|_| {
            repo.others
                .push(located(at(&origin), (Kind::GpuNode, name.to_string())))
        }),
    };
    if let Err((path, message)) = typed {
        push(report, d, &path, Severity::Error, message);
    }
}

fn located<T>((doc, origin): (usize, String), object: T) -> Located<T> {
    Located {
        doc,
        origin,
        object,
    }
}

/// Deserializes a document that passed the schema; what remains are value errors the schema
/// cannot express (a malformed duration, say), reported at their path.
fn typed<T: DeserializeOwned>(value: &Value) -> Result<T, (String, String)> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." { String::new() } else { path };
        (path, e.into_inner().to_string())
    })
}

/// Pod templates of the workload kinds users put in GitOps repositories.
fn pod_template_path(kind: &str) -> Option<&'static str> {
    match kind {
        "Job" | "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" => Some("spec.template"),
        "CronJob" => Some("spec.jobTemplate.spec.template"),
        "Pod" => Some(""),
        _ => None,
    }
}

fn read_workload(index: usize, d: &DocRef, kind: &str, repo: &mut Repo) {
    let Some(template) = pod_template_path(kind) else {
        return;
    };
    let pointer = if template.is_empty() {
        String::new()
    } else {
        format!("/{}", template.replace('.', "/"))
    };
    let meta_path = if template.is_empty() {
        "metadata".to_string()
    } else {
        format!("{template}.metadata")
    };
    let namespace = str_at(&d.doc.value, "/metadata/namespace").unwrap_or("default");
    let name = str_at(&d.doc.value, "/metadata/name").unwrap_or("<unnamed>");
    let display = format!("{kind} {namespace}/{name}");
    let lookup = |field: &str| {
        d.doc
            .value
            .pointer(&format!("{pointer}/metadata/{field}"))
            .and_then(|m| m.get(POLICY_LABEL))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let (policy, field, via_annotation) = match (lookup("labels"), lookup("annotations")) {
        (Some(p), _) => (p, "labels", false),
        (None, Some(p)) => (p, "annotations", true),
        (None, None) => return,
    };
    let spec_path = if template.is_empty() {
        "spec".to_string()
    } else {
        format!("{template}.spec")
    };
    let root_containers = d
        .doc
        .value
        .pointer(&format!("{pointer}/spec"))
        .map(|spec| root_containers(spec, &spec_path))
        .unwrap_or_default();
    let checkpoint_volume = d
        .doc
        .value
        .pointer(&format!("{pointer}/spec/volumes"))
        .and_then(Value::as_array)
        .and_then(|volumes| {
            volumes
                .iter()
                .position(|v| v["name"] == gpuslice_api::CHECKPOINT_VOLUME)
        })
        .map(|i| format!("{spec_path}.volumes[{i}]"));
    repo.workloads.push(WorkloadRef {
        doc: index,
        display,
        policy,
        path: format!("{meta_path}.{field}.{POLICY_LABEL}"),
        via_annotation,
        root_containers,
        namespace: namespace.to_string(),
        checkpoint_volume,
    });
}

/// The containers of a pod spec that may run as root (`runAsNonRoot` not true, their own or
/// else the pod's), as `PATH.containers[NAME]`, in the order admission names them.
fn root_containers(spec: &Value, spec_path: &str) -> Vec<String> {
    let non_root = |security: Option<&Value>| {
        security
            .and_then(|s| s.get("runAsNonRoot"))
            .and_then(Value::as_bool)
    };
    let pod = non_root(spec.get("securityContext")).unwrap_or(false);
    ["containers", "initContainers", "ephemeralContainers"]
        .iter()
        .flat_map(|list| {
            spec.get(list)
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter(move |c| !non_root(c.get("securityContext")).unwrap_or(pod))
                .map(move |c| {
                    let name = c.get("name").and_then(Value::as_str).unwrap_or("?");
                    format!("{spec_path}.{list}[{name}]")
                })
        })
        .collect()
}
