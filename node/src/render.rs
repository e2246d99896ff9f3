//! A pass for people: each GPU's layout now, what was (or would be) done, what it waits for, the
//! next change.

use std::fmt::Write as _;

use crate::pass::Pass;

/// The pass for people: each GPU's layout now, what was (or would be) done, the next change.
pub fn render(pass: &Pass) -> String {
    let mut out = format!(
        "node {} at {}{}\n",
        pass.node,
        pass.plan.at.format("%Y-%m-%d %H:%M UTC"),
        pass.revision
            .as_ref()
            .map(|r| format!(" (source commit {})", &r[..r.len().min(12)]))
            .unwrap_or_default()
    );
    out.push_str(&render_body(pass));
    out
}

/// The pass without its time line, to tell whether anything changed since the last one shown.
pub fn render_body(pass: &Pass) -> String {
    let mut out = String::new();
    render_source(pass, &mut out);
    render_pools(pass, &mut out);
    for g in pass.plan.nodes.iter().flat_map(|n| &n.gpus) {
        render_gpu(pass, g, &mut out);
    }
    for p in &pass.problems {
        let _ = writeln!(out, "  ERROR: {p}");
    }
    for e in &pass.drain_errors {
        let _ = writeln!(out, "  drain: ERROR: {e}");
    }
    out
}

/// Whether the source was read, and what stays in force when it was rejected.
fn render_source(pass: &Pass, out: &mut String) {
    if let Some(w) = &pass.source.warning {
        let _ = writeln!(out, "source: WARNING: {w}");
    }
    if !pass.source.ok() {
        let rejected = pass
            .source
            .rejected
            .as_ref()
            .map(|r| format!(" commit {}", &r[..r.len().min(12)]))
            .unwrap_or_default();
        let _ = writeln!(out, "source{rejected} REJECTED:");
        for p in &pass.source.problems {
            let _ = writeln!(out, "  {p}");
        }
        let _ = writeln!(
            out,
            "{}",
            if pass.source.in_force {
                "keeping the last good config"
            } else {
                "no good config yet: nothing changed"
            }
        );
    }
}

/// Each pool that holds a GPU of the node: its window in force and its next change.
fn render_pools(pass: &Pass, out: &mut String) {
    let used: Vec<&str> = pass
        .plan
        .nodes
        .iter()
        .flat_map(|n| &n.gpus)
        .filter_map(|g| g.pool())
        .collect();
    for p in pass
        .plan
        .pools
        .iter()
        .filter(|p| used.contains(&p.pool.as_str()))
    {
        let layout = p
            .window
            .as_ref()
            .map_or_else(|| "default layout".to_string(), |w| format!("window {w:?}"));
        let next = p.next_change.map_or_else(
            || "no change ahead".to_string(),
            |t| format!("next change {}", t.format("%Y-%m-%d %H:%M UTC")),
        );
        let _ = writeln!(out, "pool {}: {layout}, {next}", p.pool);
    }
}

/// One GPU: its pool, the layout it is to have, what was (or would be) done, what blocks it.
fn render_gpu(pass: &Pass, g: &gpuslice_planning::cluster::GpuPlan, out: &mut String) {
    let _ = write!(out, "  GPU {} {}", g.index, g.model);
    let Some(assigned) = &g.assigned else {
        let why = g
            .error
            .as_ref()
            .map_or_else(|| "not in any pool".to_string(), ToString::to_string);
        let _ = writeln!(out, ": {why}");
        return;
    };
    let _ = write!(
        out,
        "  pool {}{}",
        assigned.pool,
        assigned
            .window
            .as_ref()
            .map(|w| format!(" ({w})"))
            .unwrap_or_default()
    );
    let Some(o) = pass.outcomes.iter().find(|o| o.index == g.index) else {
        let _ = writeln!(
            out,
            ": ERROR: {}",
            g.error
                .as_ref()
                .map_or_else(|| "no layout".to_string(), ToString::to_string)
        );
        return;
    };
    let status = if let Some(e) = &o.error {
        format!("ERROR: {e}")
    } else if !o.blocked_by.is_empty() {
        let names: Vec<String> = o.blocked_by.iter().map(ToString::to_string).collect();
        format!(
            "BLOCKED by {}: waiting for them to exit or checkpoint",
            names.join(", ")
        )
    } else if o.ops.is_empty() {
        "up to date".to_string()
    } else if pass.applied {
        format!(
            "{} operation{} applied, {}",
            o.ops.len(),
            if o.ops.len() == 1 { "" } else { "s" },
            if o.converged {
                "confirmed"
            } else {
                "NOT confirmed"
            }
        )
    } else {
        format!(
            "{} operation{} to apply (run with --apply)",
            o.ops.len(),
            if o.ops.len() == 1 { "" } else { "s" }
        )
    };
    let _ = writeln!(out, "  → {}: {status}", o.desired);
    for op in &o.ops {
        let _ = writeln!(out, "      - {op}");
    }
    for b in &o.blocking {
        let what = pass.draining.iter().find(|w| w.pid == b.pid).map_or_else(
            || "waiting for it to exit".to_string(),
            |w| w.reason.clone(),
        );
        let _ = writeln!(out, "      pid {} on {}: {what}", b.pid, b.slice);
    }
}
