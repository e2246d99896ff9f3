//! The parameters of the chart's ValidatingAdmissionPolicy (pure; the controller writes them as
//! one ConfigMap): for each `GpuSlicePolicy`, the namespaces whose pods may use it — `*` when it
//! has no `namespaceSelector`, else the names of the namespaces its selector matches now,
//! comma-separated. The API server checks a pod against them without calling us, so admission
//! works while the operator is down (with the namespaces as last resolved). The mutating
//! admission policies read the same ConfigMap: each policy's host CPU and memory, whether its
//! pool requires non-root workloads, and where its checkpoints are stored.

use std::collections::BTreeMap;

use gpuslice_api::{CheckpointPolicy, GpuPool, GpuSlicePolicy};
use gpuslice_planning::cluster::selects;

/// The key of a policy's host CPU (`cpu_<policy>`) and memory (`memory_<policy>`) requests:
/// `_` is never in a policy's name, so these never collide with the policies' own keys.
pub fn host_key(resource: &str, policy: &str) -> String {
    format!("{resource}_{policy}")
}

/// Each policy's host CPU and memory (`spec.host`), as the mutating admission policy gives them
/// to the pod's first container as requests.
pub fn host_requests(policies: &[GpuSlicePolicy]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for p in policies {
        let (Some(name), Some(host)) = (&p.metadata.name, &p.spec.host) else {
            continue;
        };
        if let Some(cpu) = &host.cpu {
            out.insert(host_key("cpu", name), cpu.0.clone());
        }
        if let Some(memory) = &host.memory {
            out.insert(host_key("memory", name), memory.0.clone());
        }
    }
    out
}

/// The key saying a policy's pool requires non-root workloads (`nonroot_<policy>`: "true").
pub fn non_root_key(policy: &str) -> String {
    format!("nonroot_{policy}")
}

/// The policies whose pool has `requireNonRoot`, as admission parameters.
pub fn non_root_policies(
    policies: &[GpuSlicePolicy],
    pools: &[GpuPool],
) -> BTreeMap<String, String> {
    policies
        .iter()
        .filter(|p| {
            pools.iter().any(|pool| {
                pool.metadata.name.as_deref() == Some(p.spec.pool.as_str())
                    && pool.spec.require_non_root
            })
        })
        .filter_map(|p| {
            Some((
                non_root_key(p.metadata.name.as_deref()?),
                "true".to_string(),
            ))
        })
        .collect()
}

/// The key of a policy's slice count (`count_<policy>`), and of the ResourceClaimTemplate its
/// pods get a claim from instead of the extended resource (`template_<policy>`).
pub fn ask_key(what: &str, policy: &str) -> String {
    format!("{what}_{policy}")
}

/// For each policy asking for more than one slice, its `count` (the quantity admission puts in
/// a labelled pod's limits); for each with a `topology`, the ResourceClaimTemplate the queue
/// writes for it (admission adds a claim from it rather than the extended resource, which
/// carries no constraint).
pub fn slice_asks(policies: &[GpuSlicePolicy]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for p in policies {
        let Some(name) = p.metadata.name.as_deref() else {
            continue;
        };
        if p.spec.count > 1 {
            out.insert(ask_key("count", name), p.spec.count.to_string());
        }
        if p.spec.topology.is_some() {
            out.insert(
                ask_key("template", name),
                gpuslice_api::dra::device_class_name(name),
            );
        }
    }
    out
}

/// The key of the PersistentVolumeClaim (`ckptclaim_<policy>`) and of the mount path
/// (`ckptpath_<policy>`) a policy's checkpoints go to.
pub fn checkpoint_key(what: &str, policy: &str) -> String {
    format!("ckpt{what}_{policy}")
}

/// For each policy whose CheckpointPolicy (its own, else its pool's) has `storage` naming a
/// PersistentVolumeClaim: the claim and the mount path, as the mutating admission policy adds
/// them to the pod (the volume, its mount in every container, and `GPUSLICE_CHECKPOINT_DIR`).
pub fn checkpoint_storage(
    policies: &[GpuSlicePolicy],
    pools: &[GpuPool],
    checkpoints: &[&CheckpointPolicy],
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for p in policies {
        let Some(name) = p.metadata.name.as_deref() else {
            continue;
        };
        let storage = p.spec.checkpoint_policy_in(pools).and_then(|ckpt| {
            checkpoints
                .iter()
                .find(|c| c.metadata.name.as_deref() == Some(ckpt))?
                .spec
                .storage
                .as_ref()
        });
        if let Some(storage) = storage
            && let Some(claim) = &storage.persistent_volume_claim
        {
            out.insert(checkpoint_key("claim", name), claim.clone());
            out.insert(checkpoint_key("path", name), storage.mount_path.clone());
        }
    }
    out
}

/// Every namespace: the value for a policy without a `namespaceSelector`.
pub const ANY_NAMESPACE: &str = "*";

/// Policy name → the namespaces that may use it, from namespaces with their labels.
pub fn allowed_namespaces(
    policies: &[GpuSlicePolicy],
    namespaces: &[(String, BTreeMap<String, String>)],
) -> BTreeMap<String, String> {
    policies
        .iter()
        .filter_map(|p| {
            let name = p.metadata.name.clone()?;
            let allowed = match &p.spec.namespace_selector {
                None => ANY_NAMESPACE.to_string(),
                Some(selector) => {
                    let mut names: Vec<&str> = namespaces
                        .iter()
                        .filter(|(_, labels)| selects(selector, labels))
                        .map(|(n, _)| n.as_str())
                        .collect();
                    names.sort_unstable();
                    names.join(",")
                }
            };
            Some((name, allowed))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(yaml: &str) -> GpuSlicePolicy {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn a_selector_resolves_to_the_namespaces_it_matches() {
        let policies = [
            policy(
                "apiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: open}\nspec: {pool: p, memory: 1Gi}",
            ),
            policy(
                "apiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: nlp}\nspec: {pool: p, memory: 1Gi, namespaceSelector: {matchLabels: {team: nlp}}}",
            ),
            policy(
                "apiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: nobody}\nspec: {pool: p, memory: 1Gi, namespaceSelector: {matchLabels: {team: none}}}",
            ),
        ];
        let ns = |name: &str, team: &str| {
            (
                name.to_string(),
                BTreeMap::from([("team".to_string(), team.to_string())]),
            )
        };
        let got = allowed_namespaces(
            &policies,
            &[ns("b-nlp", "nlp"), ns("a-nlp", "nlp"), ns("web", "web")],
        );
        assert_eq!(got["open"], "*");
        assert_eq!(got["nlp"], "a-nlp,b-nlp");
        assert_eq!(got["nobody"], "", "no namespace may use it");
    }

    #[test]
    fn policies_of_a_non_root_pool_are_marked() {
        let policies = [
            policy(
                "apiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: notebook}\nspec: {pool: shared, memory: 1Gi}",
            ),
            policy(
                "apiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: llm}\nspec: {pool: mig, memory: 1Gi}",
            ),
        ];
        let pool = |name: &str, non_root: bool| -> GpuPool {
            serde_yaml::from_str(&format!(
                "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {{name: {name}}}\nspec: {{nodeSelector: {{}}, layout: {{exclusive: {{}}}}, requireNonRoot: {non_root}}}"
            ))
            .unwrap()
        };
        let marked = non_root_policies(&policies, &[pool("shared", true), pool("mig", false)]);
        assert_eq!(
            marked,
            BTreeMap::from([("nonroot_notebook".to_string(), "true".to_string())])
        );
    }

    #[test]
    fn checkpoint_storage_is_the_policys_own_checkpoint_policys_else_its_pools() {
        let policies = [
            policy(
                "apiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: trainer}\nspec: {pool: shared, memory: 1Gi, checkpointPolicy: durable}",
            ),
            policy(
                "apiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: notebook}\nspec: {pool: shared, memory: 1Gi}",
            ),
            policy(
                "apiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: quick}\nspec: {pool: shared, memory: 1Gi, checkpointPolicy: fleeting}",
            ),
        ];
        let pool: GpuPool = serde_yaml::from_str(
            "apiVersion: gpuslice.io/v1alpha1\nkind: GpuPool\nmetadata: {name: shared}\nspec: {nodeSelector: {}, layout: {exclusive: {}}, checkpointPolicy: pooled}",
        )
        .unwrap();
        let checkpoint = |name: &str, storage: &str| -> CheckpointPolicy {
            serde_yaml::from_str(&format!(
                "apiVersion: gpuslice.io/v1alpha1\nkind: CheckpointPolicy\nmetadata: {{name: {name}}}\nspec: {{gracePeriod: 1m{storage}}}"
            ))
            .unwrap()
        };
        let durable = checkpoint(
            "durable",
            ", storage: {persistentVolumeClaim: ckpt, mountPath: /ckpt}",
        );
        let pooled = checkpoint(
            "pooled",
            ", storage: {persistentVolumeClaim: shared-ckpt, mountPath: /state}",
        );
        // Storage without a claim mounts nothing.
        let fleeting = checkpoint("fleeting", ", storage: {mountPath: /tmp/ckpt}");
        let got = checkpoint_storage(&policies, &[pool], &[&durable, &pooled, &fleeting]);
        let want: BTreeMap<String, String> = [
            ("ckptclaim_trainer", "ckpt"),
            ("ckptpath_trainer", "/ckpt"),
            ("ckptclaim_notebook", "shared-ckpt"),
            ("ckptpath_notebook", "/state"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn host_resources_become_keys_no_policy_name_can_take() {
        let policies = [policy(
            "apiVersion: gpuslice.io/v1alpha1\nkind: GpuSlicePolicy\nmetadata: {name: llm}\nspec: {pool: p, memory: 1Gi, host: {cpu: \"4\", memory: 32Gi}}",
        )];
        let got = host_requests(&policies);
        assert_eq!(got["cpu_llm"], "4");
        assert_eq!(got["memory_llm"], "32Gi");
    }
}
