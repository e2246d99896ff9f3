//! The CDI spec that gives a prepared claim's containers their slices: device nodes, the node
//! contract's directories, the shim and its config read-only, MPS pipes, checkpoint variables.

use std::path::{Path, PathBuf};

use gpuslice_contract::{SliceConfig, SliceKind, StateDir};

use super::{Paths, records};

/// The CDI kind of our devices: ids are `gpuslice.io/slice=<claim uid>-<device>`.
pub const CDI_KIND: &str = "gpuslice.io/slice";
/// Where a container finds the node contract (the same layout as on the host).
pub const CONTAINER_STATE: &str = "/run/gpuslice";
/// Where a container finds the shim.
pub const CONTAINER_SHIM: &str = "/run/gpuslice/lib/libgpuslice.so";
/// Where a container finds its pool's dataset cache (read-only): only the content-addressed
/// objects (`objects/<sha256>`), never the rest of the cache's directory.
pub const CONTAINER_CACHE: &str = "/run/gpuslice/cache";

/// The CDI spec (version 0.6.0) giving a container its slices: each device its node, mounts and
/// checkpoint variables; the claim's devices together are the ones CUDA sees.
/// `devices`: each CDI device's name, its slice, and the claim's config of that slice.
/// `checkpoint`: the CheckpointPolicy that drains the claim's workload, whose marker path,
/// interval and signal the container is told.
pub fn cdi_spec(
    state: &StateDir,
    paths: &Paths,
    devices: &[(String, SliceConfig, PathBuf)],
    cache_of: &dyn Fn(u32) -> Option<PathBuf>,
    checkpoint: Option<&gpuslice_api::CheckpointPolicySpec>,
) -> serde_json::Value {
    let container_state = StateDir::new(CONTAINER_STATE);
    let preload = records(state).join("ld.so.preload");
    let named = devices;
    let devices: Vec<serde_json::Value> = devices
        .iter()
        .enumerate()
        .map(|(ordinal, (name, slice, claim_config))| {
            let mut env = Vec::new();
            if let Some(policy) = checkpoint {
                let marker = container_state.checkpoint_done(&slice.id);
                let told = crate::workloads::claims::checkpointing(policy).env(&marker);
                env.extend(told.into_iter().map(|(k, v)| format!("{k}={v}")));
            }
            let bind = |host: &Path, container: &Path, mode: &str| {
                serde_json::json!({"hostPath": host, "containerPath": container,
                    "options": ["rbind", mode]})
            };
            // The slice directory (ledger, checkpoint marker), then the claim's config over the
            // slice's: later mounts cover earlier ones.
            let mut mounts = vec![
                bind(
                    &state.slice(&slice.id),
                    &container_state.slice(&slice.id),
                    "rw",
                ),
                bind(claim_config, &container_state.slice_config(&slice.id), "ro"),
            ];
            // The dataset cache of the slice's pool, read-only: its objects only, so that a
            // cache directory set to a host folder of other things shows pods none of them.
            if let Some(cache) = cache_of(slice.gpu) {
                mounts.push(bind(
                    &cache.join("objects"),
                    &Path::new(CONTAINER_CACHE).join("objects"),
                    "ro",
                ));
            }
            if slice.kind.shares_gpu() {
                env.push(format!(
                    "{}={}",
                    gpuslice_contract::env::SLICE_CONFIG,
                    container_state.slice_config(&slice.id).display()
                ));
                // The config again at the fixed path the shim reads first, so the workload's
                // environment cannot switch the cap off.
                mounts.push(bind(
                    claim_config,
                    Path::new(gpuslice_contract::paths::PINNED_CONFIG),
                    "ro",
                ));
                // The socket's directory, not the socket: an agent started again binds a new
                // socket there, which a bind of the old one would never show.
                let socket_dir = |s: &StateDir| s.socket().parent().map(Path::to_path_buf);
                if let (Some(host), Some(container)) =
                    (socket_dir(state), socket_dir(&container_state))
                {
                    mounts.push(bind(&host, &container, "rw"));
                }
                if let Some(shim) = &paths.shim {
                    mounts.push(bind(shim, Path::new(CONTAINER_SHIM), "ro"));
                    mounts.push(bind(&preload, Path::new("/etc/ld.so.preload"), "ro"));
                }
            }
            if slice.kind == SliceKind::Mps {
                // The device's MPS daemon (the GPU's or the MIG instance's) at CUDA's default pipe directory, read-only: a workload
                // can neither remove its neighbours' way in nor, by unsetting the variable,
                // miss the daemon and run outside MPS.
                let pipe = Path::new(gpuslice_contract::paths::MPS_PIPE_IN_CONTAINER);
                let daemon = state.mps_pipe(gpuslice_contract::slice::mps_device_of(&slice.id));
                mounts.push(bind(&daemon, pipe, "ro"));
                // The claim's config: the policy's cap and share where they are lower.
                let given = std::fs::read(claim_config)
                    .ok()
                    .and_then(|b| serde_json::from_slice::<SliceConfig>(&b).ok())
                    .unwrap_or_else(|| slice.clone());
                env.extend(
                    crate::gpu::mps::client_env(&given, pipe, ordinal, given.memory_bytes)
                        .into_iter()
                        .map(|(k, v)| format!("{k}={v}")),
                );
            }
            // Only the nodes this host has: a runtime refuses a spec naming a missing one.
            let device_nodes: Vec<serde_json::Value> = device_nodes(slice)
                .into_iter()
                .filter(|p| Path::new(p).exists())
                .map(|p| serde_json::json!({"path": p}))
                .collect();
            serde_json::json!({
                "name": name,
                "containerEdits": {"env": env, "mounts": mounts, "deviceNodes": device_nodes},
            })
        })
        .collect();
    // Which devices the container sees is the claim's, not each device's: a device's own
    // variable would name only itself, and the last one the runtime applied would win.
    let visible: Vec<&str> = named
        .iter()
        .map(|(_, s, _)| s.device_uuid.as_str())
        .collect();
    let visible = visible.join(",");
    serde_json::json!({
        "cdiVersion": "0.6.0",
        "kind": CDI_KIND,
        "containerEdits": {"env": [
            format!("CUDA_VISIBLE_DEVICES={visible}"),
            format!("NVIDIA_VISIBLE_DEVICES={visible}"),
        ]},
        "devices": devices,
    })
}

/// The device nodes a slice's container needs: its GPU's, by the minor number NVML gave (NVML's
/// index is only an enumeration order), and the driver's control and UVM nodes.
fn device_nodes(slice: &SliceConfig) -> Vec<String> {
    let gpu = slice
        .device_minor
        .map(|minor| format!("/dev/nvidia{minor}"));
    if gpu.is_none() {
        tracing::warn!(
            slice = slice.id,
            "NVML gave no minor number for GPU {}: its device node is left out",
            slice.gpu
        );
    }
    gpu.into_iter()
        .chain(["/dev/nvidiactl".to_string(), "/dev/nvidia-uvm".to_string()])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a software slice's container is given read-only, so the workload cannot change it:
    /// its config at the pinned path, and of the pool's cache only the objects.
    #[test]
    fn a_software_slice_gets_its_config_pinned_and_only_the_cache_objects() {
        let state = StateDir::new("/run/gpuslice");
        let paths = Paths::new(
            Path::new("/var/lib/kubelet"),
            Path::new("/var/run/cdi"),
            Some(PathBuf::from("/opt/gpuslice/libgpuslice.so")),
        );
        let slice = SliceConfig {
            id: "gpu0-s1".into(),
            kind: SliceKind::Software,
            gpu: 0,
            device_minor: Some(3),
            device_uuid: "GPU-x".into(),
            memory_bytes: 8 << 30,
            compute_percent: 25,
        };
        // GPU 0 whose device node is /dev/nvidia3: the container gets that one.
        assert_eq!(
            device_nodes(&slice),
            ["/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm"]
        );
        let claim_config = PathBuf::from("/run/gpuslice/dra/uid/gpu0-s1.config");
        let spec = cdi_spec(
            &state,
            &paths,
            &[("uid-gpu0-s1".into(), slice, claim_config.clone())],
            &|_| Some(PathBuf::from("/etc")),
            Some(
                &serde_yaml::from_str("{interval: 5m, signal: SIGUSR2, gracePeriod: 1m}").unwrap(),
            ),
        );
        // The workload is told where its marker goes, how often to checkpoint and by which signal
        // it is asked to.
        let env = spec["devices"][0]["containerEdits"]["env"]
            .as_array()
            .unwrap();
        for want in [
            "GPUSLICE_CHECKPOINT_DONE=/run/gpuslice/slices/gpu0-s1/checkpoint-done",
            "GPUSLICE_CHECKPOINT_SIGNAL=SIGUSR2",
            "GPUSLICE_CHECKPOINT_INTERVAL=300",
        ] {
            assert!(env.contains(&want.into()), "{want} not in {env:?}");
        }
        let mounts = spec["devices"][0]["containerEdits"]["mounts"]
            .as_array()
            .unwrap();
        let mount_of = |container: &str| {
            mounts
                .iter()
                .find(|m| m["containerPath"] == container)
                .unwrap_or_else(|| panic!("no mount at {container}: {mounts:?}"))
        };
        let pinned = mount_of(gpuslice_contract::paths::PINNED_CONFIG);
        assert_eq!(pinned["hostPath"], claim_config.to_str().unwrap());
        assert!(pinned["options"].as_array().unwrap().contains(&"ro".into()));
        let cache = mount_of("/run/gpuslice/cache/objects");
        assert_eq!(cache["hostPath"], "/etc/objects");
        assert!(cache["options"].as_array().unwrap().contains(&"ro".into()));
        assert!(
            !mounts.iter().any(|m| m["hostPath"] == "/etc"),
            "never the cache's whole directory: {mounts:?}"
        );
    }
}
