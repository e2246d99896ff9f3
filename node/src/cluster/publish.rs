//! ResourceSlices written whole by the node's only writer, from the devices [`super::dra`] builds.

use gpuslice_api::k8s_openapi::api::core::v1::Node;
use gpuslice_api::k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use super::MANAGER;
use super::dra::{self, NodeRef};

/// Writes the node's devices as ResourceSlices, remembering what it last wrote so that an
/// unchanged pass costs no request. (Public for the scale benchmark's simulated agents.)
///
/// The agent is the only writer of its node's ResourceSlices, so it writes them whole: a create,
/// or an update of the object it last read back (its resourceVersion makes a concurrent change a
/// conflict, after which it reads them again). Server-side apply would merge into an object no
/// one else owns fields of, and costs the API server about 1.6 times the CPU per write (docs/dra.md,
/// `slice-writes`): at a window boundary every node writes its slices at once.
pub struct Publisher {
    client: Client,
    node: String,
    owner: Option<NodeRef>,
    published: Option<Vec<Device>>,
    /// The ResourceSlices as the API server returned them, so that the next change needs no
    /// list first and can update them.
    written: Option<Vec<ResourceSlice>>,
}

impl Publisher {
    pub fn new(client: Client, node: &str) -> Publisher {
        Publisher {
            client,
            node: node.to_string(),
            owner: None,
            published: None,
            written: None,
        }
    }

    /// Publishes `devices`; a failure is logged and retried on the next pass.
    pub async fn publish(&mut self, devices: Vec<Device>) {
        if self.published.as_ref() == Some(&devices) {
            return;
        }
        match self.write(&devices).await {
            Ok(()) => self.published = Some(devices),
            Err(e) => tracing::warn!("ResourceSlices of node {}: {e}", self.node),
        }
    }

    async fn write(&mut self, devices: &[Device]) -> Result<(), kube::Error> {
        let owner = match &self.owner {
            Some(owner) => owner.clone(),
            None => {
                let node = Api::<Node>::all(self.client.clone())
                    .get(&self.node)
                    .await?;
                let owner = NodeRef {
                    name: self.node.clone(),
                    uid: node.metadata.uid.unwrap_or_default(),
                };
                self.owner = Some(owner.clone());
                owner
            }
        };
        // Written against what the agent last knew; if someone else changed a slice meanwhile
        // (a conflict), once more against what is there now.
        let known = self.written.is_some();
        let existing = match self.written.take() {
            Some(written) => written,
            None => self.list().await?,
        };
        match self.write_over(&owner, devices, existing).await {
            Err(kube::Error::Api(s)) if s.code == 409 && known => {
                let existing = self.list().await?;
                self.write_over(&owner, devices, existing).await
            }
            other => other,
        }
    }

    /// The node's ResourceSlices now (an agent restarted finds its earlier ones).
    async fn list(&self) -> Result<Vec<ResourceSlice>, kube::Error> {
        let api: Api<ResourceSlice> = Api::all(self.client.clone());
        let selector = format!(
            "spec.nodeName={},spec.driver={}",
            self.node,
            gpuslice_api::dra::DRIVER
        );
        Ok(api
            .list(&ListParams::default().fields(&selector))
            .await?
            .items)
    }

    /// Replaces `existing` by the slices that publish `devices`. On a failure `written` stays
    /// empty, so the next attempt lists first.
    async fn write_over(
        &mut self,
        owner: &NodeRef,
        devices: &[Device],
        existing: Vec<ResourceSlice>,
    ) -> Result<(), kube::Error> {
        let Some(generation) = dra::next_generation(&existing, devices) else {
            self.written = Some(existing);
            return Ok(());
        };
        let api: Api<ResourceSlice> = Api::all(self.client.clone());
        let params = PostParams {
            field_manager: Some(MANAGER.to_string()),
            ..PostParams::default()
        };
        let mut written = Vec::new();
        for slice in dra::resource_slices(owner, MANAGER, devices, generation) {
            let name = slice.metadata.name.clone().unwrap_or_default();
            let stored = match existing
                .iter()
                .find(|e| e.metadata.name == slice.metadata.name)
            {
                Some(old) => {
                    api.replace(&name, &params, &dra::as_update_of(old, slice))
                        .await?
                }
                None => api.create(&params, &slice).await?,
            };
            written.push(stored);
        }
        for old in existing {
            let name = old.metadata.name.unwrap_or_default();
            if !written
                .iter()
                .any(|w| w.metadata.name.as_ref() == Some(&name))
            {
                match api.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(e),
                }
            }
        }
        self.written = Some(written);
        tracing::info!(
            "node {}: published {} devices (pool generation {generation})",
            self.node,
            devices.len()
        );
        Ok(())
    }
}
