//! The DRA kubelet plugin of driver `gpuslice.io`, inside the agent (cluster mode). It registers
//! through `<kubelet dir>/plugins_registry` and serves the kubelet's `dra/v1` calls on
//! `<kubelet dir>/plugins/gpuslice.io/dra.sock`:
//! - `NodePrepareResources`: fetches each claim, checks it is allocated devices of this driver in
//!   this node's pool that are slices in force here, records it (so a restarted agent answers the
//!   same), and writes a CDI spec per claim into the CDI directory. Its devices give the container
//!   the slice's GPU or MIG device (`CUDA_VISIBLE_DEVICES`, `NVIDIA_VISIBLE_DEVICES`, the device
//!   nodes the host has) and the slice directory of the node contract; a software slice also gets
//!   the shim through a read-only `/etc/ld.so.preload` (clearing `LD_PRELOAD` does not escape
//!   the cap), its config again read-only at `/etc/gpuslice/slice-config` (unsetting
//!   `GPUSLICE_SLICE_CONFIG` does not either) and the agent's socket for compute shares.
//! - `NodeUnprepareResources`: removes the claim's CDI spec and record. Both are idempotent.

mod authority;
mod cdi;
pub use cdi::{CDI_KIND, CONTAINER_CACHE, CONTAINER_SHIM, CONTAINER_STATE, cdi_spec};
pub mod proto;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use gpuslice_api::dra;
use gpuslice_api::k8s_openapi::api::resource::v1::ResourceClaim;
use gpuslice_contract::slice::mps_device_of;
use gpuslice_contract::{SliceConfig, SliceKind, StateDir};
use kube::Api;
use serde::{Deserialize, Serialize};

use proto::dra::d_r_a_plugin_server::{DRAPlugin, DRAPluginServer};
use proto::registration::registration_server::{Registration, RegistrationServer};

/// The plugin type the kubelet's plugin manager knows DRA drivers by.
const PLUGIN_TYPE: &str = "DRAPlugin";
/// `allocation.devices.config[].source` of what the DeviceClass gave (not the claim's author).
const CONFIG_FROM_CLASS: &str = "FromClass";
/// The service version we implement (`k8s.io/kubelet/pkg/apis/dra/v1.DRAPluginService`).
const SERVICE_VERSION: &str = "v1.DRAPlugin";
/// Why the plugin could not start or a claim could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("ResourceClaim {namespace}/{name}: {source}")]
    Fetch {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("ResourceClaim {namespace}/{name}: {reason}")]
    Claim {
        namespace: String,
        name: String,
        reason: String,
    },
    #[error("serving the kubelet plugin: {0}")]
    Serve(#[from] tonic::transport::Error),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PluginError + '_ {
    move |source| PluginError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Where the plugin meets the kubelet and the container runtime.
#[derive(Clone, Debug)]
pub struct Paths {
    /// The kubelet's plugin registry (`<kubelet dir>/plugins_registry`).
    pub registry: PathBuf,
    /// Our own sockets (`<kubelet dir>/plugins/gpuslice.io`).
    pub plugin: PathBuf,
    /// The runtime's CDI spec directory (`/var/run/cdi`).
    pub cdi: PathBuf,
    /// The shim library on the host, given to containers of software slices.
    pub shim: Option<PathBuf>,
}

impl Paths {
    pub fn new(kubelet_dir: &Path, cdi: &Path, shim: Option<PathBuf>) -> Paths {
        Paths {
            registry: kubelet_dir.join("plugins_registry"),
            plugin: kubelet_dir.join("plugins").join(dra::DRIVER),
            cdi: cdi.to_path_buf(),
            shim,
        }
    }

    pub fn registration_socket(&self) -> PathBuf {
        self.registry.join(format!("{}-reg.sock", dra::DRIVER))
    }

    pub fn dra_socket(&self) -> PathBuf {
        self.plugin.join("dra.sock")
    }

    /// The CDI spec of one claim.
    pub fn cdi_spec(&self, claim_uid: &str) -> PathBuf {
        self.cdi.join(format!("{}-{claim_uid}.json", dra::DRIVER))
    }
}

/// A prepared claim, as recorded in `<state>/dra/<uid>.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Prepared {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub devices: Vec<PreparedDevice>,
    /// The UIDs of the pods the claim is reserved for: their processes may use its slices.
    #[serde(default)]
    pub pods: Vec<String>,
    /// The same pods as `namespace/name`, for status.
    #[serde(default)]
    pub pod_names: Vec<String>,
    /// The GpuSlicePolicy of the claim's DeviceClass (its opaque parameters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    pub request: String,
    pub device: String,
    pub slice: String,
    pub cdi_id: String,
}

fn records(state: &StateDir) -> PathBuf {
    state.root().join("dra")
}

fn record_path(state: &StateDir, uid: &str) -> PathBuf {
    records(state).join(format!("{uid}.json"))
}

/// The slice config one claim's containers see: the slice's, with the policy's memory cap.
fn claim_config_path(state: &StateDir, uid: &str, slice: &str) -> PathBuf {
    records(state).join(uid).join(format!("{slice}.config"))
}

/// The config a prepared claim's containers see for `slice`, if it is there and whole.
pub fn claim_config(state: &StateDir, uid: &str, slice: &str) -> Option<SliceConfig> {
    let bytes = std::fs::read(claim_config_path(state, uid, slice)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Every claim prepared on this node (what a restarted agent still holds).
pub fn prepared(state: &StateDir) -> Vec<Prepared> {
    let Ok(entries) = std::fs::read_dir(records(state)) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok())
        .collect()
}

/// Writes `bytes` to `path` through a temporary file in the same folder (never half a file),
/// readable by everyone (the runtime, and containers' processes whatever their user).
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), PluginError> {
    write_with_mode(path, bytes, 0o644)
}

fn write_with_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<(), PluginError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = tempfile::NamedTempFile::new_in(dir).map_err(io(dir))?;
    std::fs::write(tmp.path(), bytes).map_err(io(path))?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(mode))
        .map_err(io(path))?;
    tmp.persist(path).map_err(|e| io(path)(e.error))?;
    Ok(())
}

/// The pins of a claim being prepared, given back when dropped while `key` is still set.
struct Pins<'a> {
    claims: &'a crate::workloads::claims::Claims,
    key: Option<String>,
}

impl Drop for Pins<'_> {
    fn drop(&mut self) {
        if let Some(key) = &self.key {
            self.claims.unpin(key);
        }
    }
}

/// The plugin's state: the API client, this node, the agent's state directory.
pub struct Plugin {
    client: kube::Client,
    node: String,
    state: StateDir,
    paths: Paths,
    /// The dataset caches, mounted read-only into containers of their pools' slices.
    caches: std::sync::Arc<crate::protections::cache::Caches>,
    /// The slices `gpuslice run` holds: not prepared for a pod as well.
    claims: std::sync::Arc<crate::workloads::claims::Claims>,
    /// One claim change at a time: the kubelet may call concurrently.
    lock: tokio::sync::Mutex<()>,
}

/// A claim's allocation as the plugin prepares it.
struct Allocation {
    /// The UIDs and `namespace/name`s of the pods it is reserved for.
    pods: Vec<String>,
    pod_names: Vec<String>,
    /// The policy its class names, and the memory cap it gives.
    policy: Option<String>,
    memory_limit: Option<u64>,
    /// The policy's compute limit (%), which an MPS slice's workload is given as its SM share.
    compute_limit: Option<u32>,
    /// The CheckpointPolicy that drains its workload (the policy's, else its pool's).
    checkpoint_policy: Option<String>,
    /// Each device: its CDI device name, the request it answers, and the slice in force.
    devices: Vec<(String, String, SliceConfig)>,
}

impl Plugin {
    pub fn new(
        client: kube::Client,
        node: &str,
        state: StateDir,
        paths: Paths,
        caches: std::sync::Arc<crate::protections::cache::Caches>,
        claims: std::sync::Arc<crate::workloads::claims::Claims>,
    ) -> Plugin {
        Plugin {
            client,
            node: node.to_string(),
            state,
            paths,
            caches,
            claims,
            lock: tokio::sync::Mutex::new(()),
        }
    }

    /// What the API says the claim is allocated: this node's slices in force (refused
    /// otherwise), the pods it is reserved for, and its class's parameters.
    async fn allocation(&self, claim: &proto::Claim) -> Result<Allocation, PluginError> {
        let refuse = |reason: String| PluginError::Claim {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            reason,
        };
        let object = Api::<ResourceClaim>::namespaced(self.client.clone(), &claim.namespace)
            .get(&claim.name)
            .await
            .map_err(|source| PluginError::Fetch {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                source,
            })?;
        if object.metadata.uid.as_deref() != Some(claim.uid.as_str()) {
            return Err(refuse(format!(
                "the kubelet asked for uid {} but the claim now has uid {}",
                claim.uid,
                object.metadata.uid.unwrap_or_default()
            )));
        }
        let status = object.status.unwrap_or_default();
        let reserved: Vec<_> = status
            .reserved_for
            .iter()
            .flatten()
            .filter(|r| r.resource == "pods")
            .collect();
        let pods: Vec<String> = reserved.iter().map(|r| r.uid.clone()).collect();
        let pod_names: Vec<String> = reserved
            .iter()
            .map(|r| format!("{}/{}", claim.namespace, r.name))
            .collect();
        let allocated = status
            .allocation
            .and_then(|a| a.devices)
            .unwrap_or_default();
        // The class's parameters only: a claim may carry opaque config for this driver too,
        // and a tenant writes its claims (another policy's name, a larger cap).
        let parameters: Vec<dra::ClassParameters> = allocated
            .config
            .iter()
            .flatten()
            .filter(|c| c.source == CONFIG_FROM_CLASS)
            .filter_map(|c| c.opaque.as_ref())
            .filter(|o| o.driver == dra::DRIVER)
            .filter_map(|o| serde_json::from_value(o.parameters.0.clone()).ok())
            .collect();
        let policy = parameters
            .iter()
            .map(|p| p.policy.clone())
            .find(|p| !p.is_empty());
        let memory_limit = parameters.iter().find_map(|p| p.memory_limit_bytes);
        let compute_limit = parameters
            .iter()
            .find_map(|p| p.compute.as_ref().map(|c| c.limit));
        let checkpoint_policy = parameters.iter().find_map(|p| p.checkpoint_policy.clone());
        let results = allocated.results.unwrap_or_default();
        let slices = crate::gpu::slices::published(&self.state);
        let mut devices = Vec::new();
        for result in results.iter().filter(|r| r.driver == dra::DRIVER) {
            if result.pool != self.node {
                return Err(refuse(format!(
                    "device {} is in pool {}, not on node {}",
                    result.device, result.pool, self.node
                )));
            }
            let slice = slices
                .iter()
                .find(|s| dra::device_name(&s.id) == result.device)
                .ok_or_else(|| {
                    refuse(format!(
                        "device {} is not a slice in force on node {} (re-sliced since it was allocated?)",
                        result.device, self.node
                    ))
                })?;
            devices.push((
                format!("{}-{}", claim.uid, result.device),
                result.request.clone(),
                slice.clone(),
            ));
        }
        if devices.is_empty() {
            return Err(refuse(format!("it is allocated no {} device", dra::DRIVER)));
        }
        Ok(Allocation {
            pods,
            pod_names,
            policy,
            memory_limit,
            compute_limit,
            checkpoint_policy,
            devices,
        })
    }

    /// Prepares one claim (or answers what was prepared for it before).
    pub async fn prepare(&self, claim: &proto::Claim) -> Result<Prepared, PluginError> {
        let _one = self.lock.lock().await;
        let record = record_path(&self.state, &claim.uid);
        if let Ok(bytes) = std::fs::read(&record)
            && let Ok(done) = serde_json::from_slice::<Prepared>(&bytes)
        {
            return Ok(done);
        }
        let given = self.allocation(claim).await?;
        let refuse = |reason: String| PluginError::Claim {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            reason,
        };
        let software: Vec<&str> = given
            .devices
            .iter()
            .filter(|(_, _, s)| s.kind.shares_gpu())
            .map(|(_, _, s)| s.id.as_str())
            .collect();
        if software.len() > 1 {
            // The shim caps a container to one slice config: a second would go uncounted in its
            // GPU's ledger, and that GPU's other tenants would find its memory gone.
            return Err(refuse(format!(
                "it was allocated {} software slices ({}), and a container is capped to one: ask for one software slice per claim, or use a pool of whole GPUs or MIG instances for several",
                software.len(),
                software.join(", ")
            )));
        }
        // A container of an MPS slice without its device's daemon would run outside MPS.
        if let Some((_, _, s)) = given.devices.iter().find(|(_, _, s)| {
            s.kind == SliceKind::Mps
                && !self
                    .state
                    .mps_pipe(mps_device_of(&s.id))
                    .join(crate::gpu::mps::CONTROL_SOCKET)
                    .exists()
        }) {
            return Err(refuse(format!(
                "the MPS control daemon of {} (GPU {}) is not running (the GpuNode's status says why); the kubelet asks again",
                mps_device_of(&s.id),
                s.gpu
            )));
        }
        let ids: Vec<String> = given.devices.iter().map(|(_, _, s)| s.id.clone()).collect();
        let key = format!("{}/{}", claim.namespace, claim.name);
        self.claims.pin(&ids, &key).map_err(|held| {
            refuse(format!(
                "{held}; the pod starts once that command ends (the kubelet asks again)"
            ))
        })?;
        // Until the claim is recorded as prepared, a failure gives the slices back.
        let mut pins = Pins {
            claims: &self.claims,
            key: Some(key),
        };
        let preload = records(&self.state).join("ld.so.preload");
        if self.paths.shim.is_some() && !preload.exists() {
            write_atomically(&preload, format!("{CONTAINER_SHIM}\n").as_bytes())?;
        }
        let mut named: Vec<(String, SliceConfig, PathBuf)> = Vec::new();
        for (name, _, slice) in &given.devices {
            crate::gpu::slices::new_workload(&self.state, &slice.id);
            // An MPS slice's share of the SMs is the policy's limit where that is lower (the
            // arbiter keeps a time-sliced one's).
            let compute_percent = match given.compute_limit {
                Some(limit) if slice.kind == SliceKind::Mps => limit.min(slice.compute_percent),
                _ => slice.compute_percent,
            };
            let config = SliceConfig {
                memory_bytes: given
                    .memory_limit
                    .map_or(slice.memory_bytes, |m| m.min(slice.memory_bytes)),
                compute_percent,
                ..slice.clone()
            };
            let path = claim_config_path(&self.state, &claim.uid, &slice.id);
            write_with_mode(
                &path,
                &serde_json::to_vec_pretty(&config).unwrap_or_default(),
                0o444,
            )?;
            named.push((name.clone(), slice.clone(), path));
        }
        let checkpoint = match &given.checkpoint_policy {
            Some(name) => Api::<gpuslice_api::CheckpointPolicy>::all(self.client.clone())
                .get_opt(name)
                .await
                .map_err(|e| {
                    refuse(format!(
                        "reading its CheckpointPolicy {name:?}: {e}; the kubelet asks again"
                    ))
                })?
                .map(|p| p.spec),
            None => None,
        };
        let spec = cdi_spec(
            &self.state,
            &self.paths,
            &named,
            &|gpu| self.caches.root_for_gpu(gpu),
            checkpoint.as_ref(),
        );
        write_atomically(
            &self.paths.cdi_spec(&claim.uid),
            &serde_json::to_vec_pretty(&spec).unwrap_or_default(),
        )?;
        let done = Prepared {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            uid: claim.uid.clone(),
            devices: given
                .devices
                .into_iter()
                .map(|(name, request, slice)| PreparedDevice {
                    request,
                    device: dra::device_name(&slice.id),
                    slice: slice.id,
                    cdi_id: format!("{CDI_KIND}={name}"),
                })
                .collect(),
            pods: given.pods,
            pod_names: given.pod_names,
            policy: given.policy,
        };
        // Recorded last: a crash before this prepares again, from scratch.
        write_atomically(
            &record,
            &serde_json::to_vec_pretty(&done).unwrap_or_default(),
        )?;
        pins.key = None;
        tracing::info!(
            "prepared ResourceClaim {}/{}: {:?}",
            done.namespace,
            done.name,
            done.devices.iter().map(|d| &d.slice).collect::<Vec<_>>()
        );
        Ok(done)
    }

    /// Unprepares one claim; one that is not prepared is done already.
    pub async fn unprepare(&self, claim: &proto::Claim) -> Result<(), PluginError> {
        let _one = self.lock.lock().await;
        for path in [
            self.paths.cdi_spec(&claim.uid),
            record_path(&self.state, &claim.uid),
        ] {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&path)(e)),
                _ => {}
            }
        }
        let configs = records(&self.state).join(&claim.uid);
        match std::fs::remove_dir_all(&configs) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&configs)(e)),
            _ => {}
        }
        tracing::info!(
            "unprepared ResourceClaim {}/{}",
            claim.namespace,
            claim.name
        );
        Ok(())
    }

    /// Serves the registration and DRA sockets until the process ends.
    pub async fn serve(mut self) -> Result<(), PluginError> {
        // Containers mount the shim from the host: a copy in the state directory (a host path
        // when the agent runs in a pod), not the agent image's.
        if let Some(shim) = self.paths.shim.take() {
            let on_host = records(&self.state).join("libgpuslice.so");
            let bytes = std::fs::read(&shim).map_err(io(&shim))?;
            if std::fs::read(&on_host).ok().as_deref() != Some(bytes.as_slice()) {
                write_atomically(&on_host, &bytes)?;
            }
            self.paths.shim = Some(on_host);
        }
        let registration_socket = self.paths.registration_socket();
        let dra_socket = self.paths.dra_socket();
        let bind = |path: &Path| -> Result<tokio::net::UnixListener, PluginError> {
            let dir = path.parent().unwrap_or(Path::new("."));
            std::fs::create_dir_all(dir).map_err(io(dir))?;
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(path)(e)),
                _ => {}
            }
            tokio::net::UnixListener::bind(path).map_err(io(path))
        };
        // The DRA socket first: the kubelet calls it as soon as it sees the registration.
        let dra_listener = bind(&dra_socket)?;
        let registration_listener = bind(&registration_socket)?;
        let registrar = Registrar {
            endpoint: dra_socket.display().to_string(),
        };
        let plugin = std::sync::Arc::new(self);
        let dra = tonic::transport::Server::builder()
            .add_service(DRAPluginServer::from_arc(plugin))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(
                dra_listener,
            ));
        // The kubelet's registration client sends the socket path as `:authority`.
        let registration_connections = tokio_stream::StreamExt::map(
            tokio_stream::wrappers::UnixListenerStream::new(registration_listener),
            |connection| connection.map(authority::LocalAuthority::new),
        );
        let registration = tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(registrar))
            .serve_with_incoming(registration_connections);
        tracing::info!(
            "kubelet plugin {}: registration {}, DRA {}",
            dra::DRIVER,
            registration_socket.display(),
            dra_socket.display()
        );
        tokio::try_join!(dra, registration)?;
        Ok(())
    }
}

struct Registrar {
    endpoint: String,
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn get_info(
        &self,
        _: tonic::Request<proto::InfoRequest>,
    ) -> Result<tonic::Response<proto::PluginInfo>, tonic::Status> {
        Ok(tonic::Response::new(proto::PluginInfo {
            r#type: PLUGIN_TYPE.to_string(),
            name: dra::DRIVER.to_string(),
            endpoint: self.endpoint.clone(),
            supported_versions: vec![SERVICE_VERSION.to_string()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: tonic::Request<proto::RegistrationStatus>,
    ) -> Result<tonic::Response<proto::RegistrationStatusResponse>, tonic::Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!("the kubelet registered plugin {}", dra::DRIVER);
        } else {
            tracing::warn!(
                "the kubelet refused plugin {}: {}",
                dra::DRIVER,
                status.error
            );
        }
        Ok(tonic::Response::new(proto::RegistrationStatusResponse {}))
    }
}

#[tonic::async_trait]
impl DRAPlugin for Plugin {
    async fn node_prepare_resources(
        &self,
        request: tonic::Request<proto::NodePrepareResourcesRequest>,
    ) -> Result<tonic::Response<proto::NodePrepareResourcesResponse>, tonic::Status> {
        let mut claims = HashMap::new();
        let request = request.into_inner();
        tracing::info!(
            "NodePrepareResources: {}",
            request
                .claims
                .iter()
                .map(|c| format!("{}/{} ({})", c.namespace, c.name, c.uid))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for claim in request.claims {
            let answer = match self.prepare(&claim).await {
                Ok(done) => proto::NodePrepareResourceResponse {
                    devices: done
                        .devices
                        .into_iter()
                        .map(|d| proto::Device {
                            request_names: vec![d.request],
                            pool_name: self.node.clone(),
                            device_name: d.device,
                            cdi_device_ids: vec![d.cdi_id],
                            share_id: None,
                        })
                        .collect(),
                    error: String::new(),
                },
                Err(e) => {
                    tracing::warn!("{e}");
                    proto::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error: e.to_string(),
                    }
                }
            };
            claims.insert(claim.uid.clone(), answer);
        }
        Ok(tonic::Response::new(proto::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: tonic::Request<proto::NodeUnprepareResourcesRequest>,
    ) -> Result<tonic::Response<proto::NodeUnprepareResourcesResponse>, tonic::Status> {
        let mut claims = HashMap::new();
        for claim in request.into_inner().claims {
            let error = self
                .unprepare(&claim)
                .await
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            claims.insert(
                claim.uid.clone(),
                proto::NodeUnprepareResourceResponse { error },
            );
        }
        Ok(tonic::Response::new(
            proto::NodeUnprepareResourcesResponse { claims },
        ))
    }
}
