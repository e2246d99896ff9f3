//! What the operator and the node agent share to run, so that the agent does not depend on the
//! operator: the clock (which tests may shift), conditions that keep their transition times,
//! server-side apply bodies of our kinds, `/metrics` and `/healthz`, logging, the libraries
//! built beside the binary, and a plain HTTP GET.

pub mod built;
pub mod clock;
pub mod conditions;
pub mod http;
pub mod logging;
pub mod telemetry;

use serde::Serialize;

/// Buckets (seconds) of the pass and reconcile duration histograms: 1 ms doubling to ~8 s.
pub const DURATION_BUCKETS: (f64, f64, u16) = (0.001, 2.0, 14);

/// Prometheus buckets for a pass or reconcile duration.
pub fn duration_buckets() -> impl Iterator<Item = f64> {
    let (start, factor, count) = DURATION_BUCKETS;
    prometheus_client::metrics::histogram::exponential_buckets(start, factor, count)
}

/// A server-side apply body for one of our cluster-scoped kinds: `apiVersion`, `kind`,
/// `metadata.name` and one top-level field (`spec` or `status`), which is all the writer owns.
pub fn apply_body(
    kind: &str,
    name: &str,
    field: &str,
    value: &impl Serialize,
) -> serde_json::Value {
    let mut body = serde_json::json!({
        "apiVersion": gpuslice_api::API_VERSION,
        "kind": kind,
        "metadata": {"name": name},
    });
    body[field] = serde_json::to_value(value).unwrap_or_default();
    body
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_apply_body_names_the_object_and_carries_one_field() {
        let body = super::apply_body("GpuNode", "n1", "spec", &serde_json::json!({"gpus": []}));
        assert_eq!(
            body,
            serde_json::json!({
                "apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuNode",
                "metadata": {"name": "n1"}, "spec": {"gpus": []},
            })
        );
    }
}
