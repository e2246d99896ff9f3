//! One DeviceClass per `GpuSlicePolicy` (pure; the controller applies them): named
//! `<policy>.gpuslice.io`, requestable as the extended resource `gpuslice.io/<policy>`, selecting
//! the devices the agents publish for the policy's pool that fit it — memory at least the
//! policy's plus the pool's headroom and, on software slices, compute at least its limit (the
//! rule of `planning::fit`) — and carrying the policy's parameters as opaque config for the
//! driver, which gives them to the workload's slice.

use std::collections::BTreeMap;

use gpuslice_api::dra::{self, ClassCompute, ClassParameters, attribute, capacity, kind};
use gpuslice_api::{GpuPool, GpuSlicePolicy, bytes_of};
use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, DeviceClass, DeviceClassConfiguration, DeviceClassSpec, DeviceSelector,
    OpaqueDeviceConfiguration, ResourceClaimTemplate,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;

/// A CEL string literal.
fn literal(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

/// The memory a policy's workload may use: its `memory` plus its pool's `memoryHeadroom` (the
/// CUDA context and allocator slack count against the cap too).
pub(crate) fn memory_limit(policy: &GpuSlicePolicy, pools: &[GpuPool]) -> u64 {
    let spec = &policy.spec;
    let headroom = pools
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(spec.pool.as_str()))
        .map_or(0, |p| p.spec.headroom_bytes());
    bytes_of(&spec.memory.0)
        .unwrap_or(u64::MAX)
        .saturating_add(headroom)
}

/// The CEL expression selecting the devices a policy may get.
pub fn selector(policy: &GpuSlicePolicy, pools: &[GpuPool]) -> String {
    let spec = &policy.spec;
    let need = memory_limit(policy, pools);
    let attr = |name: &str| format!("device.attributes[{}].{name}", literal(dra::DRIVER));
    let cap = |name: &str| format!("device.capacity[{}].{name}", literal(dra::DRIVER));
    let mut terms = vec![
        format!("device.driver == {}", literal(dra::DRIVER)),
        format!("{} == {}", attr(attribute::POOL), literal(&spec.pool)),
        format!(
            "{}.compareTo(quantity({})) >= 0",
            cap(capacity::MEMORY),
            literal(&need.to_string())
        ),
    ];
    if let Some(compute) = &spec.compute {
        terms.push(format!(
            "(!({} in [{}, {}]) || {}.compareTo(quantity({})) >= 0)",
            attr(attribute::KIND),
            literal(kind::SOFTWARE),
            literal(kind::MPS),
            cap(capacity::COMPUTE),
            literal(&compute.limit.to_string())
        ));
    }
    terms.join(" && ")
}

/// What the driver is told about a policy, in the class's opaque config: `memoryLimitBytes` is
/// the cap the kubelet plugin gives the workload's slice.
pub fn parameters(name: &str, policy: &GpuSlicePolicy, pools: &[GpuPool]) -> ClassParameters {
    let spec = &policy.spec;
    ClassParameters {
        api_version: gpuslice_api::API_VERSION.to_string(),
        kind: dra::PARAMETERS_KIND.to_string(),
        policy: name.to_string(),
        pool: spec.pool.clone(),
        memory: spec.memory.0.clone(),
        memory_limit_bytes: Some(memory_limit(policy, pools)),
        compute: spec.compute.as_ref().map(|c| ClassCompute {
            limit: c.limit,
            guarantee: c.guarantee.unwrap_or(0),
        }),
        // The one that drains its workloads: its own, else its pool's.
        checkpoint_policy: spec.checkpoint_policy_in(pools).map(str::to_string),
    }
}

/// The name of the request in a policy's ResourceClaimTemplate, and of the pod's claim the
/// chart's admission adds for it.
pub const TEMPLATE_REQUEST: &str = "gpuslice";

/// The ResourceClaimTemplate, in `namespace`, of a policy with a `topology`: its `count` devices
/// of the policy's DeviceClass, all with one `nvlinkDomain` (a constraint the extended resource
/// cannot carry, so the chart's admission gives such a policy's labelled pods a claim from this
/// template instead). Named like the DeviceClass; deleted with the policy.
pub fn claim_template(
    policy: &GpuSlicePolicy,
    namespace: &str,
    manager: &str,
) -> Option<ResourceClaimTemplate> {
    let name = policy.metadata.name.clone()?;
    policy.spec.topology?;
    let class = dra::device_class_name(&name);
    let constraint = format!("{}/{}", dra::DRIVER, attribute::NVLINK_DOMAIN);
    let spec = serde_json::json!({
        "spec": {"devices": {
            "requests": [{"name": TEMPLATE_REQUEST, "exactly": {
                "deviceClassName": class,
                "allocationMode": "ExactCount",
                "count": policy.spec.count,
            }}],
            "constraints": [{"requests": [TEMPLATE_REQUEST], "matchAttribute": constraint}],
        }}
    });
    Some(ResourceClaimTemplate {
        metadata: ObjectMeta {
            name: Some(class),
            namespace: Some(namespace.to_string()),
            labels: Some(BTreeMap::from([
                (dra::MANAGED_BY_LABEL.to_string(), manager.to_string()),
                (dra::POLICY_CLASS_LABEL.to_string(), name.clone()),
            ])),
            owner_references: owner(policy, &name),
            ..ObjectMeta::default()
        },
        spec: serde_json::from_value(spec).ok()?,
    })
}

/// The policy as the owner of what is written for it.
fn owner(policy: &GpuSlicePolicy, name: &str) -> Option<Vec<OwnerReference>> {
    policy.metadata.uid.clone().map(|uid| {
        vec![OwnerReference {
            api_version: gpuslice_api::API_VERSION.to_string(),
            kind: "GpuSlicePolicy".to_string(),
            name: name.to_string(),
            uid,
            controller: Some(true),
            block_owner_deletion: None,
        }]
    })
}

/// The DeviceClass of every policy whose pool exists, by class name. A policy read before its
/// pool (separate watches) gets no class yet: one written then would carry no pool headroom, and
/// a pod allocated meanwhile would keep that smaller cap.
pub fn device_classes(
    policies: &[GpuSlicePolicy],
    pools: &[GpuPool],
    manager: &str,
) -> BTreeMap<String, DeviceClass> {
    policies
        .iter()
        .filter(|policy| {
            pools
                .iter()
                .any(|p| p.metadata.name.as_deref() == Some(policy.spec.pool.as_str()))
        })
        .filter_map(|policy| {
            let name = policy.metadata.name.clone()?;
            let class = DeviceClass {
                metadata: ObjectMeta {
                    name: Some(dra::device_class_name(&name)),
                    labels: Some(BTreeMap::from([
                        (dra::MANAGED_BY_LABEL.to_string(), manager.to_string()),
                        (dra::POLICY_CLASS_LABEL.to_string(), name.clone()),
                    ])),
                    // Deleting the policy deletes its class (the operator also removes classes
                    // whose policy is gone, in case it was down then).
                    owner_references: owner(policy, &name),
                    ..ObjectMeta::default()
                },
                spec: DeviceClassSpec {
                    extended_resource_name: Some(dra::extended_resource_name(&name)),
                    selectors: Some(vec![DeviceSelector {
                        cel: Some(CELDeviceSelector {
                            expression: selector(policy, pools),
                        }),
                    }]),
                    config: Some(vec![DeviceClassConfiguration {
                        opaque: Some(OpaqueDeviceConfiguration {
                            driver: dra::DRIVER.to_string(),
                            parameters: RawExtension(
                                serde_json::to_value(parameters(&name, policy, pools))
                                    .unwrap_or_default(),
                            ),
                        }),
                    }]),
                },
            };
            Some((dra::device_class_name(&name), class))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(yaml: &str) -> GpuSlicePolicy {
        serde_yaml::from_str(yaml).unwrap()
    }

    fn pool() -> GpuPool {
        serde_yaml::from_str(
            r#"
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata: {name: infer}
spec:
  nodeSelector: {}
  memoryHeadroom: 1Gi
  layout: {kind: Exclusive}
"#,
        )
        .unwrap()
    }

    #[test]
    fn a_policy_selects_its_pools_slices_that_hold_it() {
        let p = policy(
            r#"
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: llm-7b, uid: u-1}
spec: {pool: infer, memory: 18Gi, compute: {limit: 25, guarantee: 10}, checkpointPolicy: standard}
"#,
        );
        let classes = device_classes(std::slice::from_ref(&p), &[pool()], "op");
        let class = &classes["llm-7b.gpuslice.io"];
        assert_eq!(
            class.spec.extended_resource_name.as_deref(),
            Some("gpuslice.io/llm-7b")
        );
        let cel = &class.spec.selectors.as_ref().unwrap()[0]
            .cel
            .as_ref()
            .unwrap()
            .expression;
        assert_eq!(
            cel,
            r#"device.driver == "gpuslice.io" && device.attributes["gpuslice.io"].pool == "infer" && device.capacity["gpuslice.io"].memory.compareTo(quantity("20401094656")) >= 0 && (!(device.attributes["gpuslice.io"].kind in ["software", "mps"]) || device.capacity["gpuslice.io"].compute.compareTo(quantity("25")) >= 0)"#
        );
        let opaque = class.spec.config.as_ref().unwrap()[0]
            .opaque
            .as_ref()
            .unwrap();
        assert_eq!(opaque.driver, "gpuslice.io");
        assert_eq!(
            opaque.parameters.0,
            serde_json::json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "SliceParameters",
                "policy": "llm-7b", "pool": "infer", "memory": "18Gi", "memoryLimitBytes": 20401094656u64,
                "compute": {"limit": 25, "guarantee": 10}, "checkpointPolicy": "standard"})
        );
        assert_eq!(
            class.metadata.owner_references.as_ref().unwrap()[0].uid,
            "u-1"
        );
    }

    #[test]
    fn without_a_compute_limit_any_kind_with_the_memory_fits() {
        let p = policy(
            r#"
apiVersion: gpuslice.io/v1alpha1
kind: GpuSlicePolicy
metadata: {name: batch}
spec: {pool: nowhere, memory: 1Gi}
"#,
        );
        let cel = selector(&p, &[pool()]);
        assert!(cel.contains(r#"pool == "nowhere""#), "{cel}");
        assert!(
            cel.contains(r#"quantity("1073741824")"#),
            "no headroom of another pool: {cel}"
        );
        assert!(!cel.contains("compute"), "{cel}");
    }
}
