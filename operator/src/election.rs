//! Leader election through a `coordination.k8s.io` Lease, so that only one operator replica
//! writes. The leader renews the lease every third of its duration; another replica takes it
//! over once it has not been renewed for a whole duration. A replica that cannot renew in time
//! stops writing before anyone else can start.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};

/// Whether this replica leads; shared with the reconcile loop.
#[derive(Clone, Default)]
pub struct Leadership(Arc<AtomicBool>);

impl Leadership {
    pub fn is_leader(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Holds or waits for the lease `name` in `namespace` as `identity`, in the background.
pub fn start(
    client: Client,
    namespace: &str,
    name: &str,
    identity: &str,
    duration: Duration,
) -> Leadership {
    let leadership = Leadership::default();
    let flag = leadership.clone();
    let api: Api<Lease> = Api::namespaced(client, namespace);
    let (name, identity) = (name.to_string(), identity.to_string());
    tokio::spawn(async move {
        loop {
            let leading = match try_lead(&api, &name, &identity, duration).await {
                Ok(leading) => leading,
                Err(e) => {
                    tracing::warn!("lease {name}: {e}");
                    false
                }
            };
            if leading != flag.is_leader() {
                tracing::info!(
                    "{identity} {} the lease {name}",
                    if leading { "holds" } else { "does not hold" }
                );
            }
            flag.0.store(leading, Ordering::Release);
            tokio::time::sleep(duration / 3).await;
        }
    });
    leadership
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

async fn try_lead(
    api: &Api<Lease>,
    name: &str,
    identity: &str,
    duration: Duration,
) -> Result<bool, kube::Error> {
    let seconds = i32::try_from(duration.as_secs()).unwrap_or(i32::MAX).max(1);
    let Some(mut lease) = api.get_opt(name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(identity.to_string()),
                lease_duration_seconds: Some(seconds),
                acquire_time: Some(now()),
                renew_time: Some(now()),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        return Ok(api.create(&PostParams::default(), &lease).await.is_ok());
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    let mine = spec.holder_identity.as_deref() == Some(identity);
    if !mine {
        let held_for = spec.lease_duration_seconds.unwrap_or(seconds);
        let expired = spec.renew_time.as_ref().is_none_or(|t| {
            t.0.checked_add(SignedDuration::from_secs(i64::from(held_for)))
                .is_ok_and(|end| end < Timestamp::now())
        });
        if !expired {
            return Ok(false);
        }
        spec.holder_identity = Some(identity.to_string());
        spec.acquire_time = Some(now());
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.renew_time = Some(now());
    spec.lease_duration_seconds = Some(seconds);
    // The resourceVersion makes this a compare-and-swap: of two replicas, one wins.
    Ok(api
        .replace(name, &PostParams::default(), &lease)
        .await
        .is_ok())
}
