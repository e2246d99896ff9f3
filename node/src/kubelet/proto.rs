//! The messages of the kubelet's plugin protocols, written from their definitions:
//! `k8s.io/kubelet/pkg/apis/pluginregistration/v1/api.proto` (package `pluginregistration`) and
//! `k8s.io/kubelet/pkg/apis/dra/v1/api.proto` (package `k8s.io.kubelet.pkg.apis.dra.v1`).
//! Field numbers are the protocol's.

use std::collections::HashMap;

// pluginregistration

#[derive(Clone, PartialEq, prost::Message)]
pub struct InfoRequest {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginInfo {
    /// `DRAPlugin` for a DRA driver.
    #[prost(string, tag = "1")]
    pub r#type: String,
    /// The driver name.
    #[prost(string, tag = "2")]
    pub name: String,
    /// The socket of the DRA service.
    #[prost(string, tag = "3")]
    pub endpoint: String,
    #[prost(string, repeated, tag = "4")]
    pub supported_versions: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RegistrationStatus {
    #[prost(bool, tag = "1")]
    pub plugin_registered: bool,
    #[prost(string, tag = "2")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RegistrationStatusResponse {}

// dra v1

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodePrepareResourcesRequest {
    #[prost(message, repeated, tag = "1")]
    pub claims: Vec<Claim>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodePrepareResourcesResponse {
    /// Claim UID → what was prepared for it, or why not.
    #[prost(map = "string, message", tag = "1")]
    pub claims: HashMap<String, NodePrepareResourceResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodePrepareResourceResponse {
    #[prost(message, repeated, tag = "1")]
    pub devices: Vec<Device>,
    /// Non-empty: preparing the claim failed (the kubelet retries).
    #[prost(string, tag = "2")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Device {
    #[prost(string, repeated, tag = "1")]
    pub request_names: Vec<String>,
    #[prost(string, tag = "2")]
    pub pool_name: String,
    #[prost(string, tag = "3")]
    pub device_name: String,
    /// Fully qualified CDI device ids the runtime applies to the container.
    #[prost(string, repeated, tag = "4")]
    pub cdi_device_ids: Vec<String>,
    #[prost(string, optional, tag = "5")]
    pub share_id: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeUnprepareResourcesRequest {
    #[prost(message, repeated, tag = "1")]
    pub claims: Vec<Claim>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeUnprepareResourcesResponse {
    #[prost(map = "string, message", tag = "1")]
    pub claims: HashMap<String, NodeUnprepareResourceResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeUnprepareResourceResponse {
    #[prost(string, tag = "1")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Claim {
    #[prost(string, tag = "1")]
    pub namespace: String,
    #[prost(string, tag = "2")]
    pub uid: String,
    #[prost(string, tag = "3")]
    pub name: String,
}

/// The generated services (server and client halves).
pub mod registration {
    include!(concat!(
        env!("OUT_DIR"),
        "/pluginregistration.Registration.rs"
    ));
}

pub mod dra {
    include!(concat!(
        env!("OUT_DIR"),
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin.rs"
    ));
}
