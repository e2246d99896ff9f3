//! Demand the user's Prometheus expects, for elastic sets that name one (`elastic.prometheus`):
//! a task reads each set's instant query through Prometheus' HTTP API (`/api/v1/query`) every
//! [`READ_EVERY`] and wakes the reconcile loop when an answer changes. A failed read replaces
//! the last answer with why it failed: the shaping never acts on an old or missing answer, and
//! the pool's `ElasticSignal` condition says what happened.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuslice_api::{ElasticPrometheus, GpuPool};
use gpuslice_planning::shaping::Prometheus;
use gpuslice_runtime::clock::Clock;
use kube::runtime::reflector::Store;
use tokio::sync::Notify;

/// How often each query is read.
pub const READ_EVERY: Duration = Duration::from_secs(30);
const TIMEOUTS: gpuslice_runtime::http::Timeouts = gpuslice_runtime::http::Timeouts {
    connect: Duration::from_secs(3),
    idle: Duration::from_secs(10),
};
/// The most of an answer read (a query returning more is an error, not a memory hazard).
const MAX_ANSWER: usize = 4 << 20;

/// Pool → its Prometheus' last answer, shared with the reconcile loop.
#[derive(Clone, Default)]
pub struct Signals(Arc<Mutex<BTreeMap<String, Prometheus>>>);

impl Signals {
    /// The last answer of every pool whose set in force names a Prometheus.
    pub fn read(&self) -> BTreeMap<String, Prometheus> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The Prometheus the elastic set in force on `pool` at `at` names, if any.
pub fn prometheus_of(
    pool: &GpuPool,
    at: chrono::DateTime<chrono::Utc>,
) -> Option<&ElasticPrometheus> {
    let (_, timing) = gpuslice_planning::cluster::pool_timing(pool, at);
    gpuslice_planning::shaping::set_in_force(pool, timing.window.as_deref())?
        .prometheus
        .as_ref()
}

/// Reads every pool's Prometheus each [`READ_EVERY`] into `signals`, waking `changed` when an
/// answer differs from the last. Runs until the process ends.
pub async fn run(pools: Store<GpuPool>, clock: Clock, signals: Signals, changed: Arc<Notify>) {
    loop {
        let now = clock.now();
        let wanted: Vec<(String, ElasticPrometheus)> = pools
            .state()
            .iter()
            .filter_map(|p| Some((p.metadata.name.clone()?, prometheus_of(p, now)?.clone())))
            .collect();
        let mut read = BTreeMap::new();
        for (pool, source) in wanted {
            let answer = query(&source).await;
            if let Err(e) = &answer {
                tracing::warn!("GpuPool/{pool}: elastic.prometheus: {e}");
            }
            read.insert(pool, answer);
        }
        let differs = {
            let mut last = signals.0.lock().unwrap_or_else(|p| p.into_inner());
            let differs = *last != read;
            *last = read;
            differs
        };
        if differs {
            changed.notify_one();
        }
        tokio::time::sleep(READ_EVERY).await;
    }
}

/// One instant query: pods expected per policy.
async fn query(source: &ElasticPrometheus) -> Prometheus {
    let url = format!(
        "{}/api/v1/query?{}",
        source.url.trim_end_matches('/'),
        form_urlencoded::Serializer::new(String::new())
            .append_pair("query", &source.query)
            .finish()
    );
    let mut body = Vec::new();
    gpuslice_runtime::http::get(&url, TIMEOUTS, &mut |chunk| {
        if body.len() + chunk.len() > MAX_ANSWER {
            return Err(std::io::Error::other(format!(
                "the answer exceeds {MAX_ANSWER} bytes"
            )));
        }
        body.extend_from_slice(chunk);
        Ok(())
    })
    .await
    .map_err(|e| format!("Prometheus {}: {}", source.url, e.reason))?;
    expected(&body).map_err(|e| format!("Prometheus {} query {:?}: {e}", source.url, source.query))
}

/// Pods expected per policy from an answer of `/api/v1/query`: a vector whose samples carry a
/// `policy` label (others are ignored); a negative or non-finite value counts as 0, two samples
/// of one policy as their sum.
pub fn expected(body: &[u8]) -> Result<BTreeMap<String, f64>, String> {
    #[derive(serde::Deserialize)]
    struct Answer {
        status: String,
        #[serde(default)]
        error: Option<String>,
        #[serde(default)]
        data: Option<Data>,
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Data {
        result_type: String,
        result: serde_json::Value,
    }
    #[derive(serde::Deserialize)]
    struct Sample {
        metric: BTreeMap<String, String>,
        value: (f64, String),
    }
    let answer: Answer =
        serde_json::from_slice(body).map_err(|e| format!("not a Prometheus API answer: {e}"))?;
    if answer.status != "success" {
        return Err(answer.error.unwrap_or(answer.status));
    }
    let data = answer.data.ok_or("the answer has no data")?;
    if data.result_type != "vector" {
        return Err(format!(
            "the query returns a {}; it must return a vector whose samples carry a `policy` label",
            data.result_type
        ));
    }
    let samples: Vec<Sample> =
        serde_json::from_value(data.result).map_err(|e| format!("unreadable samples: {e}"))?;
    let mut out: BTreeMap<String, f64> = BTreeMap::new();
    for s in samples {
        let Some(policy) = s.metric.get("policy") else {
            continue;
        };
        let v: f64 = s.value.1.parse().unwrap_or(0.0);
        let v = if v.is_finite() { v.max(0.0) } else { 0.0 };
        *out.entry(policy.clone()).or_default() += v;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_gives_pods_per_policy_and_a_wrong_one_says_why() {
        let ok = br#"{"status":"success","data":{"resultType":"vector","result":[
            {"metric":{"policy":"big"},"value":[1733.5,"2"]},
            {"metric":{"policy":"big","zone":"b"},"value":[1733.5,"1.5"]},
            {"metric":{"policy":"small"},"value":[1733.5,"-3"]},
            {"metric":{"policy":"nan"},"value":[1733.5,"NaN"]},
            {"metric":{"job":"x"},"value":[1733.5,"9"]}]}}"#;
        let got = expected(ok).unwrap();
        assert_eq!(
            got,
            BTreeMap::from([
                ("big".to_string(), 3.5),
                ("nan".to_string(), 0.0),
                ("small".to_string(), 0.0)
            ])
        );
        let scalar =
            br#"{"status":"success","data":{"resultType":"scalar","result":[1733.5,"2"]}}"#;
        assert!(expected(scalar).unwrap_err().contains("returns a scalar"));
        let bad = br#"{"status":"error","errorType":"bad_data","error":"parse error at char 3"}"#;
        assert_eq!(expected(bad).unwrap_err(), "parse error at char 3");
        assert!(
            expected(b"<html>")
                .unwrap_err()
                .contains("not a Prometheus API answer")
        );
    }
}
