//! The kubelet's plugin protocols (`pluginregistration` v1 and `dra` v1), generated from their
//! service definitions written out here; the messages are in `src/kubelet/proto.rs`.

fn method(name: &str, route: &str, input: &str, output: &str) -> tonic_build::manual::Method {
    tonic_build::manual::Method::builder()
        .name(name)
        .route_name(route)
        .input_type(format!("crate::kubelet::proto::{input}"))
        .output_type(format!("crate::kubelet::proto::{output}"))
        .codec_path("tonic_prost::ProstCodec")
        .build()
}

fn main() {
    let registration = tonic_build::manual::Service::builder()
        .name("Registration")
        .package("pluginregistration")
        .method(method("get_info", "GetInfo", "InfoRequest", "PluginInfo"))
        .method(method(
            "notify_registration_status",
            "NotifyRegistrationStatus",
            "RegistrationStatus",
            "RegistrationStatusResponse",
        ))
        .build();
    let dra = tonic_build::manual::Service::builder()
        .name("DRAPlugin")
        .package("k8s.io.kubelet.pkg.apis.dra.v1")
        .method(method(
            "node_prepare_resources",
            "NodePrepareResources",
            "NodePrepareResourcesRequest",
            "NodePrepareResourcesResponse",
        ))
        .method(method(
            "node_unprepare_resources",
            "NodeUnprepareResources",
            "NodeUnprepareResourcesRequest",
            "NodeUnprepareResourcesResponse",
        ))
        .build();
    tonic_build::manual::Builder::new()
        .build_transport(false)
        .compile(&[registration, dra]);
}
