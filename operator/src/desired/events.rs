//! The Events a pool's status change deserves.

use gpuslice_api::GpuPoolStatus;
use gpuslice_api::k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

/// Something worth an Event on a pool: (warning?, reason, note).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolEvent {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

fn find<'a>(status: &'a GpuPoolStatus, kind: &str) -> Option<&'a Condition> {
    status.conditions.iter().find(|c| c.type_ == kind)
}

/// The window a status says is in force; a status written before `default` was spelt out says
/// nothing for the default layout.
fn window_in_force(status: &GpuPoolStatus) -> &str {
    status
        .active_window
        .as_deref()
        .unwrap_or(gpuslice_api::DEFAULT_WINDOW)
}

/// The events a status change deserves: a window opening or closing, a pool turning invalid,
/// a transition getting blocked. Nothing on the first status of a pool but its problems.
pub fn events(old: Option<&GpuPoolStatus>, new: &GpuPoolStatus) -> Vec<PoolEvent> {
    let mut out = Vec::new();
    if let Some(old) = old
        && old.observed_generation.is_some()
        && window_in_force(old) != window_in_force(new)
    {
        out.push(PoolEvent {
            warning: false,
            reason: "WindowChanged",
            note: format!(
                "{} is in force now; re-slicing {} GPUs on {} nodes",
                match new.active_window.as_deref() {
                    None | Some(gpuslice_api::DEFAULT_WINDOW) => "the default layout".to_string(),
                    Some(w) => format!("window {w}"),
                },
                new.gpus,
                new.nodes
            ),
        });
    }
    let was = |kind: &str, reason: Option<&str>| {
        old.and_then(|o| find(o, kind))
            .is_some_and(|c| c.status == "True" && reason.is_none_or(|r| c.reason == r))
    };
    if let Some(c) = find(new, "Degraded")
        && c.status == "True"
        && (!was("Degraded", None)
            || old.and_then(|o| find(o, "Degraded")).map(|o| &o.message) != Some(&c.message))
    {
        out.push(PoolEvent {
            warning: true,
            reason: if c.reason == "DriverOutdated" {
                "DriverOutdated"
            } else {
                "InvalidConfiguration"
            },
            note: c.message.clone(),
        });
    }
    let last_recut = |s: &GpuPoolStatus| s.elastic.as_ref().and_then(|e| e.last_recut.clone());
    if let Some(recut) = last_recut(new)
        && old.and_then(last_recut).as_ref() != Some(&recut)
    {
        out.push(PoolEvent {
            warning: false,
            reason: "ElasticRecut",
            note: recut.reason,
        });
    }
    if let Some(c) = find(new, "Progressing")
        && c.status == "True"
        && c.reason == "Blocked"
        && !was("Progressing", Some("Blocked"))
    {
        out.push(PoolEvent {
            warning: true,
            reason: "Blocked",
            note: c.message.clone(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuslice_runtime::conditions::condition;

    fn status(window: Option<&str>, degraded: Option<&str>, blocked: bool) -> GpuPoolStatus {
        GpuPoolStatus {
            observed_generation: Some(1),
            active_window: window.map(str::to_string),
            conditions: vec![
                condition(
                    "Degraded",
                    degraded.is_some(),
                    "X",
                    degraded.unwrap_or("").into(),
                    Some(1),
                ),
                condition(
                    "Progressing",
                    blocked,
                    if blocked { "Blocked" } else { "Converged" },
                    "busy".into(),
                    Some(1),
                ),
            ],
            ..GpuPoolStatus::default()
        }
    }

    #[test]
    fn events_mark_window_changes_new_problems_and_new_blocks_once() {
        let day = status(None, None, false);
        assert!(events(None, &day).is_empty());
        assert!(events(Some(&day), &day).is_empty(), "nothing changed");
        let night = status(Some("night"), None, false);
        assert_eq!(events(Some(&day), &night)[0].reason, "WindowChanged");
        let blocked = status(Some("night"), None, true);
        assert_eq!(events(Some(&night), &blocked)[0].reason, "Blocked");
        assert!(events(Some(&blocked), &blocked).is_empty(), "once");
        let broken = status(None, Some("bad profile"), false);
        assert_eq!(events(None, &broken)[0].note, "bad profile");
        assert!(events(Some(&broken), &broken).is_empty());
    }
}
