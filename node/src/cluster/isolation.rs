//! Fault isolation and the watchdog, told to the cluster: quarantines acted on and kept,
//! the reset annotation taken, and Events on the GpuNode and on the pods concerned.

use gpuslice_api::GpuNode;
use gpuslice_api::k8s_openapi::api::core::v1::ObjectReference;
use gpuslice_runtime::clock::Clock;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};

use crate::pass::Pass;
use crate::protections::faults::{self, Notice, Quarantines};

/// Fault isolation after a pass: acts on the XIDs received (for GPUs whose pool isolates
/// faults), lifts the quarantines of slices their faulting workloads released and of GPUs the
/// `gpuslice.io/gpu-reset` annotation says were reset (then removes it), and keeps the list.
pub(super) async fn isolate_faults(
    api: &Api<GpuNode>,
    current: &GpuNode,
    pass: &Pass,
    quarantines: &mut Quarantines,
    inbox: &faults::Inbox,
    isolating: &std::collections::BTreeSet<String>,
    clock: &Clock,
) -> Vec<Notice> {
    let before = quarantines.list.clone();
    let held = pass.holdings();
    let events = inbox.take(std::time::Instant::now());
    let in_force = current.spec.in_force(clock.now());
    let isolating_gpu = |gpu: u32| {
        in_force
            .gpus
            .iter()
            .any(|a| a.index == gpu && isolating.contains(&a.assigned.pool))
    };
    let node = &pass.node;
    let key = gpuslice_api::dra::GPU_RESET_ANNOTATION;
    let annotated = current
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .cloned();
    // Root may also say so on the node (`gpuslice gpu-reset`).
    let mut resets = inbox.take_resets();
    resets.extend(annotated.clone());
    let notices = faults::isolate(
        &mut quarantines.list,
        &events,
        &pass.inventory,
        &held,
        &isolating_gpu,
        &resets,
        clock.now(),
    );
    if annotated.is_some() {
        // Said once: the annotation is a request, not a state.
        let patch = serde_json::json!({"metadata": {"annotations": {key: null}}});
        if let Err(e) = api
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            tracing::warn!("GpuNode/{node}: removing {key}: {e}");
        }
    }
    if quarantines.list != before
        && let Err(e) = quarantines.save()
    {
        tracing::error!("keeping the quarantines: {e}");
    }
    notices
}

/// Tells what fault isolation did: Events on the GpuNode and on the pods of a quarantined
/// slice, and the log.
pub(super) async fn tell_faults(
    recorder: &Recorder,
    gpu_node: &ObjectReference,
    node: &str,
    notices: &[Notice],
) {
    let publish = |type_: EventType, reason: &str, note: String, regarding: ObjectReference| {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "IsolateFault".into(),
            secondary: None,
        };
        async move {
            if let Err(e) = recorder.publish(&event, &regarding).await {
                tracing::warn!("recording a fault event: {e}");
            }
        }
    };
    for notice in notices {
        let (warning, text) = notice.text(node);
        if warning {
            tracing::warn!("node {node}: {text}");
        } else {
            tracing::info!("node {node}: {text}");
        }
        let (reason, type_) = match notice {
            Notice::SliceQuarantined { .. } => ("SliceQuarantined", EventType::Warning),
            Notice::GpuOut(_) => ("GpuOutOfService", EventType::Warning),
            Notice::Lifted { .. } => ("QuarantineLifted", EventType::Normal),
            Notice::Unattributed { .. } => ("XidUnattributed", EventType::Warning),
            Notice::BadReset { .. } => ("BadGpuReset", EventType::Warning),
            // Counted only: the log and the metric say it.
            Notice::Counted { .. } => continue,
        };
        publish(type_, reason, text, gpu_node.clone()).await;
        if let Notice::SliceQuarantined {
            quarantine,
            pods,
            uids,
        } = notice
        {
            for (i, pod) in pods.iter().enumerate() {
                let Some((namespace, name)) = pod.split_once('/') else {
                    continue;
                };
                let note = format!(
                    "{} on its slice {}{}: the slice takes no new work until this pod releases it; the other slices of GPU {} keep running",
                    quarantine.what(),
                    quarantine.slice.as_deref().unwrap_or_default(),
                    quarantine
                        .pid
                        .map(|p| format!(" (pid {p})"))
                        .unwrap_or_default(),
                    quarantine.gpu
                );
                let regarding = pod_reference(namespace, name, uids.get(i).cloned());
                publish(EventType::Warning, "GpuFault", note, regarding).await;
            }
        }
    }
}

/// What an Event about a pod names.
fn pod_reference(namespace: &str, name: &str, uid: Option<String>) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid,
        ..ObjectReference::default()
    }
}

/// An Event on each pod of a workload that missed its CheckpointPolicy's interval.
pub(super) async fn tell_overdue(
    recorder: &Recorder,
    pass: &crate::pass::Pass,
    now: chrono::DateTime<chrono::Utc>,
) {
    for overdue in &pass.overdue {
        let Some(claim) = pass
            .claims
            .iter()
            .find(|c| c.slice == overdue.slice && c.resource_claim.is_some())
        else {
            tracing::warn!("{}", overdue.text(now));
            continue;
        };
        for (i, pod) in claim.pod_names.iter().enumerate() {
            let Some((namespace, name)) = pod.split_once('/') else {
                continue;
            };
            let event = Event {
                type_: EventType::Warning,
                reason: "CheckpointOverdue".into(),
                note: Some(overdue.text(now)),
                action: "WatchCheckpointInterval".into(),
                secondary: None,
            };
            let regarding = pod_reference(namespace, name, claim.pods.get(i).cloned());
            if let Err(e) = recorder.publish(&event, &regarding).await {
                tracing::warn!("recording a checkpoint event: {e}");
            }
        }
    }
}

/// An Event on each pod of a slice the watchdog found over its memory cap or compute limit.
pub(super) async fn tell_overrun(
    recorder: &Recorder,
    report: &crate::protections::watchdog::Report,
) {
    use crate::protections::watchdog::Finding;
    let (holding, reason, action) = match &report.finding {
        Finding::Overrun(o) => (&o.holding, "GpuMemoryOverCap", "EnforceMemoryCap"),
        Finding::Compute(c) => (&c.holding, "GpuComputeOverLimit", "EnforceComputeLimit"),
        Finding::Stray(_) => return,
    };
    for (i, pod) in holding.pods.iter().enumerate() {
        let Some((namespace, name)) = pod.split_once('/') else {
            continue;
        };
        let event = Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(report.text()),
            action: action.into(),
            secondary: None,
        };
        let regarding = pod_reference(namespace, name, holding.pod_uids.get(i).cloned());
        if let Err(e) = recorder.publish(&event, &regarding).await {
            tracing::warn!("recording a watchdog event: {e}");
        }
    }
}
