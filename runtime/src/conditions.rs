//! Status conditions as the Kubernetes API conventions want them: `observedGeneration` set, and
//! `lastTransitionTime` kept while a condition's status does not change.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// A condition; its transition time is filled in by [`keep_transition_times`].
pub fn condition(
    kind: &str,
    status: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
) -> Condition {
    Condition {
        type_: kind.to_string(),
        status: if status { "True" } else { "False" }.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time: Time(Timestamp::UNIX_EPOCH),
    }
}

/// Gives each condition the transition time of the old one of its type while its status stays,
/// and now when the status changed.
pub fn keep_transition_times(conditions: &mut [Condition], old: &[Condition]) {
    for c in conditions {
        c.last_transition_time = old
            .iter()
            .find(|o| o.type_ == c.type_ && o.status == c.status)
            .map_or_else(
                || Time(Timestamp::now()),
                |o| o.last_transition_time.clone(),
            );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_condition_keeps_its_transition_time_until_its_status_changes() {
        let mut old = vec![condition("Ready", true, "Applied", String::new(), Some(1))];
        old[0].last_transition_time = Time(Timestamp::from_second(1_000).unwrap());
        let mut same = vec![condition("Ready", true, "Applied", "again".into(), Some(2))];
        keep_transition_times(&mut same, &old);
        assert_eq!(same[0].last_transition_time, old[0].last_transition_time);
        let mut flipped = vec![condition("Ready", false, "Failed", String::new(), Some(2))];
        keep_transition_times(&mut flipped, &old);
        assert!(flipped[0].last_transition_time.0 > old[0].last_transition_time.0);
    }
}
